"""The checkpoint tests fork worker processes from the test process, and the single-process
ones expect no process group: a group leaked by an earlier test would be inherited by both."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_leaked_process_group():
    assert not dist.is_initialized(), "an earlier test left a process group initialized"
    yield
