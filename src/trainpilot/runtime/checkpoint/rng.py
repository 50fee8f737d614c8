"""Capture and restore every random-number generator a training step can draw from.

Python's ``random``, NumPy's global generator, torch's CPU generator and the accelerator's
generators (CUDA, or whatever ``torch.accelerator`` reports, e.g. Ascend through torch_npu).
States are plain data (lists and tensors) so they can be checkpointed without pickles.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _device_module() -> Any | None:
    accel = getattr(torch, "accelerator", None)
    if accel is None or not accel.is_available():
        return None
    device = accel.current_accelerator()
    return torch.get_device_module(device.type) if device is not None else None


def capture_rng_state() -> dict[str, Any]:
    """The state of every generator this process uses, as JSON-ready data plus tensors."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(x) for x in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    module = _device_module()
    # Only a device this process has used: reading its RNG would otherwise initialize it (slow,
    # and impossible in a process forked after the parent initialized it).
    if module is not None and getattr(module, "is_initialized", lambda: True)():
        state["device"] = list(module.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; device states are skipped on a host without one
    (and applied lazily, at the device's first use, by torch itself)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state({
        "bit_generator": npy["bit_generator"],
        "state": {"key": np.asarray(npy["key"], dtype=np.uint32), "pos": npy["pos"]},
        "has_gauss": npy["has_gauss"], "gauss": npy["gauss"],
    })
    torch.set_rng_state(state["torch"].to(torch.uint8))
    module = _device_module()
    if module is not None and "device" in state:
        module.set_rng_state_all([t.to(torch.uint8) for t in state["device"]])
