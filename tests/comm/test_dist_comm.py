"""Tier 3: the hooks on real gloo process groups (2-4 ranks spawned by tests/comm/_launch.py).

Every scenario runs its checks inside one spawn and returns plain numbers; the assertions are
here. Oracles carry negative controls: a perturbed input must break hierarchical == flat, and
dropping the residual (no error feedback / no restored state) must break the invariant and the
bit-exact resume.
"""

from __future__ import annotations

import pytest

from tests.comm._launch import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.timeout(120)
def test_hierarchical_equals_flat(tmp_path):
    results = run_ranks("hierarchy", 4, tmp_path, timeout_s=100)
    for out in results:
        for layout in ("2x2", "racks", "2x2.top", "racks.top"):
            assert out[f"{layout}.int64.equal"], layout
            assert out[f"{layout}.f64int.equal"], layout
            assert out[f"{layout}.f64.max_rel"] < 1e-15
            assert out[f"{layout}.f32.max_rel"] < 1e-6
        assert out["2x2.stages"] == [2, 2]  # intra-node reduce-scatter, inter-node all-reduce
        assert out["racks.stages"] == [2, 2]  # in-rack reduce-scatter, cross-rack all-reduce
        assert out["2x2.inplace_equal"] and out["racks.inplace_equal"]
        assert not out["2x2.control_equal"] and not out["racks.control_equal"]
        # The byte model against the kernel's count of bytes written to gloo's sockets.
        for label in ("flat", "hier"):
            assert out[f"wire.{label}.measured"] == pytest.approx(out[f"wire.{label}.model"],
                                                                  rel=2e-3)
        assert out["wire.hier.off_node"] == out["wire.hier.model"] // 3
    # Flat ring on 2 nodes x 2: ranks 1 and 3 send everything across; hierarchical: a third each.
    assert [o["wire.flat.off_node"] for o in results] == [0, 6291456, 0, 6291456]


@pytest.mark.timeout(150)
def test_ddp_hooks(tmp_path):
    out = run_ranks("ddp", 4, tmp_path, timeout_s=130)[0]
    for label in ("none.flat", "none.hier", "none.hier.nooverlap", "none.flat.nooverlap"):
        assert out[f"{label}.max_rel_vs_ref"] < 1e-14, label
        assert out[f"{label}.buckets"][0] == 1 and out[f"{label}.buckets"][-1] > 1  # rebuilt
    for label in ("none.hier.nooverlap", "none.flat.nooverlap", "bf16.hier.nooverlap"):
        assert out[f"{label}.bit_equal_overlap"], label
    for label in ("fp16.flat", "fp16.hier"):
        assert 0 < out[f"{label}.max_rel_vs_ref"] < 5e-3, label
    for label in ("bf16.flat", "bf16.hier.nooverlap"):
        assert 0 < out[f"{label}.max_rel_vs_ref"] < 2e-2, label
    # Error feedback: what was transmitted + the residuals == the sum of the true gradients.
    for label in ("topk.flat.ef", "topk.flat.ef.allgather", "topk.4nodes.ef", "topk.hier.ef",
                  "topk.hier.ef.nooverlap"):
        assert out[f"{label}.invariant_rel"] < 1e-14, label
        assert out[f"{label}.bucket_independent"], label
    for label in ("topk.flat.noef", "topk.hier.noef"):  # negative control
        assert out[f"{label}.invariant_rel"] > 0.05, label
    # float64 model: 15% of 8-byte values + a 1-bit-per-element bitmap, plus the per-parameter
    # minimum of one entry: one rank's message for the whole bucket.
    message = 0.15 + 1 / 64
    assert out["topk.flat.ef.allgather.payload_over_dense"] == pytest.approx(message, abs=0.01)
    # 4 ranks, all-gather: 3 messages out per rank; the sparse reduce-scatter ("auto" at 4):
    # 3/4 of a message for the scatter and 3/4 for the gather, as a ring all-reduce (2 x 3/4
    # of the dense bytes), so the ratio to dense no longer grows with the rank count.
    assert out["topk.flat.ef.allgather.wire_over_dense"] == pytest.approx(3 * message, abs=0.03)
    assert out["topk.flat.ef.wire_over_dense"] == pytest.approx(1.5 * message, abs=0.02)
    assert out["none.flat.wire_over_dense"] == pytest.approx(1.5, abs=1e-3)
    # 4 nodes of 1 rank: every byte leaves its node, at the same 1.5 messages.
    assert out["topk.4nodes.ef.off_node_over_dense"] == pytest.approx(1.5 * message, abs=0.02)
    # Hierarchical: only the inter-node stage is compressed; half a bucket crosses per rank.
    assert out["topk.hier.ef.off_node_over_dense"] == pytest.approx(
        out["topk.flat.ef.allgather.payload_over_dense"] / 2, rel=0.05)
    assert out["powersgd.buckets"] == [1, 1, 1, 1]
    assert out["powersgd.payload_over_dense"] < 0.5
    assert out["powersgd.max_rel_vs_ref"] > 1e-3  # it did compress
    assert "PowerSGD on gloo needs one bucket" in out["powersgd.multibucket_refused"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exchange", ["all_gather", "scatter"])
def test_resume_is_bit_exact_with_compression(tmp_path, exchange):
    """The scatter exchange keeps the owners' unsent sums in the same per-rank residuals."""
    args = {"dir": str(tmp_path), "exchange": exchange}
    full = run_ranks("resume", 2, tmp_path, timeout_s=50, args=dict(args, phase="full"))
    restart = run_ranks("resume", 2, tmp_path, timeout_s=50, args=dict(args, phase="restart"))
    for whole, resumed in zip(full, restart):
        assert resumed["digest.comm_state=True"] == whole["digest"]
        assert resumed["digest.comm_state=False"] != whole["digest"]  # residuals matter


@pytest.mark.timeout(150)
def test_topk_with_error_feedback_converges(tmp_path):
    """A small reference GPT on the Markov corpus, 100 steps on 2 ranks, held-out loss."""
    loss = run_ranks("converge", 2, tmp_path, timeout_s=130, args={"steps": 100})[0]
    floor = loss["floor"]
    excess = {k: v - floor for k, v in loss.items() if k != "floor"}
    assert excess["none"] < 0.2 * excess["initial"]  # it learned most of the chain
    # 15% density with error feedback stays close to uncompressed (the benchmark's target of
    # 1% is on tiny-gpt; this faster model is measured at about 1.1%).
    assert loss["topk15.ef"] < 1.02 * loss["none"]
    # At 1% density, dropping what was not sent (no error feedback) loses clearly more.
    assert excess["topk1.ef"] < 0.85 * excess["topk1.noef"]
