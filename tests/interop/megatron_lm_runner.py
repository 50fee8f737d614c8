"""Run Megatron-LM's own ``parse_args`` + ``validate_args`` on exported flag sets.

Megatron-LM's argument parser lives in its repository (``megatron/training/arguments.py``),
not in the ``megatron-core`` wheel, so this runs only where ``MEGATRON_LM_ROOT`` points at a
checkout of the tag matching the installed megatron-core (``core_v0.16.1``). Two stand-ins,
neither a validation rule: the GPU query (an H100, compute capability 9, as there is no GPU
here) and the triton batch-invariant kernels module that ``megatron.training`` imports.

Reads ``[{"id", "argv", "env", "world_size"}]`` as JSON on stdin, prints one JSON object
``{id: "ok" | error text}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from unittest import mock


def main() -> None:
    root = os.environ["MEGATRON_LM_ROOT"]
    sys.path.insert(0, root)
    sys.modules["megatron.core.transformer.custom_layers.batch_invariant_kernels"] = \
        mock.MagicMock()
    import megatron

    megatron.__path__.append(os.path.join(root, "megatron"))
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 9
    arguments.torch.cuda.get_device_capability = lambda *a: (9, 0)
    results = {}
    for case in json.load(sys.stdin):
        saved = dict(os.environ)
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        os.environ.update(case["env"], WORLD_SIZE=str(case["world_size"]), RANK="0")
        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        err_text = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err_text):
                args = arguments.parse_args()
                arguments.validate_args(args)
            results[case["id"]] = "ok"
        except (AssertionError, ValueError, SystemExit, TypeError, KeyError) as err:
            tail = err_text.getvalue().strip().splitlines()[-1:] or [""]
            results[case["id"]] = f"{type(err).__name__}: {err} {tail[0]}".strip()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
