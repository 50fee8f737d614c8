"""The availability step of ``trainpilot demo``."""

from __future__ import annotations

import io

from rich.console import Console

from trainpilot.sim.demo import availability_rows, demo_availability
from trainpilot.specs import load_job


def test_demo_table_compares_three_policies():
    job = load_job("gpt3-175b-a100-1024")
    buffer = io.StringIO()
    demo_availability(Console(file=buffer, width=200), job)
    text = buffer.getvalue()
    for name in ("restart from storage", "in-memory peer checkpoints", "hot spares"):
        assert name in text
    _, _, rows = availability_rows(job)
    (storage, s_mc, _), (peer, p_mc, _), (hot, h_mc, _) = rows
    # Peer copies restore faster and lose less; hot spares also remove the replacement wait.
    assert p_mc.badput_h["restore"] < s_mc.badput_h["restore"]
    assert h_mc.badput_h["spare_wait"] < p_mc.badput_h["spare_wait"]
    assert s_mc.ettr < p_mc.ettr < h_mc.ettr
    assert hot.recovery.num_spares >= 2 and peer.checkpoint.in_memory_peer
