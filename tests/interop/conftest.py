"""The consumers' validators run on this CPU-only machine: stand-ins for GPU kernel modules
that their packages import at module level (never for a validation rule)."""

from __future__ import annotations

import importlib.util
import sys
from unittest import mock

# torchtitan 0.3.0's MoE token dispatcher imports its triton kernels at import time; the CPU
# torch wheel has no triton. The kernels are never called here (nothing is run on a GPU).
if importlib.util.find_spec("triton") is None:
    sys.modules.setdefault("torchtitan.distributed.minimal_async_ep.kernels", mock.MagicMock())
