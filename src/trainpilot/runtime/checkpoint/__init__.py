"""Checkpoints: async, sharded (DCP), incremental, verified, with an in-memory peer tier.

Start with :class:`Checkpointer` (checkpointer.py); the folder layout is in layout.py, the
on-disk format in storage.py, the peer tier in peer.py. docs/checkpoints.md has the design.
"""

from trainpilot.runtime.checkpoint.checkpointer import Checkpointer, SaveHandle
from trainpilot.runtime.checkpoint.config import (
    CheckpointConfig,
    CheckpointWriteError,
    Restored,
    SaveReport,
)
from trainpilot.runtime.checkpoint.layout import CorruptCheckpoint, committed, read_manifest
from trainpilot.runtime.checkpoint.oracle import diff_states
from trainpilot.runtime.checkpoint.restore import TemplateMismatch
from trainpilot.runtime.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "CheckpointConfig",
    "CheckpointWriteError",
    "Checkpointer",
    "CorruptCheckpoint",
    "Restored",
    "SaveHandle",
    "SaveReport",
    "TemplateMismatch",
    "capture_rng_state",
    "committed",
    "diff_states",
    "read_manifest",
    "restore_rng_state",
]
