"""The layout search: exact against brute force, honest statistics, uneven stages, no-fit."""

from __future__ import annotations

import pytest

from trainpilot.perf import Estimator, Layout
from trainpilot.perf.group import Group
from trainpilot.plan import SearchSpace, search
from trainpilot.plan.search import _Walk, is_duplicate
from trainpilot.plan.space import splits
from trainpilot.specs import SpecError, check_job, load_cluster, load_model

CASE = dict(model="llama3-8b", cluster="h100-sxm-x32", gbs=64, seq=4096)


def _brute_force(model, cluster, gbs, seq, top, headroom=0.1):
    """Every layout the search enumerates, each costed: the reference ranking. A layout that
    fits with less recomputation dominates its heavier-recompute copies (slower, and the memory
    they save is not needed), so, as in the search, only the lightest recompute mode that fits
    is ranked for each (layout, micro-batch, ZeRO, sequence parallel)."""
    est = Estimator(model, cluster)
    limit = est.device("bf16").hbm_bytes * (1 - headroom)
    walk = _Walk(model, cluster, est, SearchSpace(), gbs, seq, "bf16", limit, top)
    steps = []
    for base, mbs, variants, _ in walk._families():
        zeros, modes, sps = variants
        for mb in mbs:
            for zero in zeros:
                probe = Layout(zero=zero, recompute="none", sequence_parallel=False,
                               micro_batch_size=mb, **base)
                if is_duplicate(zero, zeros, probe.dp * probe.cp, probe.num_micro_batches,
                                probe.rt.grad_sync):
                    continue
                for sp in sps:
                    for mode in modes:  # none, selective, full: lightest first
                        lay = Layout(zero=zero, recompute=mode, sequence_parallel=sp,
                                     micro_batch_size=mb, **base)
                        step, _ = est.quick(lay, limit)
                        if step is not None:
                            steps.append(step)
                            break
    return sorted(steps)[:top], walk.enumerated


def _docs():
    return load_model(CASE["model"]), load_cluster(CASE["cluster"])


def test_search_matches_brute_force():
    model, cluster = _docs()
    expected, enumerated = _brute_force(model, cluster, CASE["gbs"], CASE["seq"], top=5)
    result = search(model, cluster, global_batch_size=CASE["gbs"], seq_len=CASE["seq"], top=5)
    assert [c.prediction.step_time_s for c in result] == pytest.approx(expected, rel=1e-9)
    assert result.stats.enumerated == enumerated
    for cand in result:  # every returned plan is a valid document for this cluster
        check_job(model, cluster, cand.plan)
        assert cand.prediction.memory_gib["peak"] <= 80 * 0.9


def test_a_wrong_bound_is_caught(monkeypatch):
    """Negative control: a bound that overestimates prunes good plans, and the comparison
    with brute force notices."""
    model, cluster = _docs()
    expected, _ = _brute_force(model, cluster, CASE["gbs"], CASE["seq"], top=5)
    real = Group.lower_bound
    monkeypatch.setattr(Group, "lower_bound",
                        lambda self, sp, recompute="none": 1.5 * real(self, sp, recompute))
    result = search(model, cluster, global_batch_size=CASE["gbs"], seq_len=CASE["seq"], top=5)
    assert [c.prediction.step_time_s for c in result] != pytest.approx(expected, rel=1e-9)


def test_statistics_account_for_every_layout():
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-80gb-x1024")
    result = search(model, cluster, global_batch_size=1536, seq_len=2048, top=5)
    s = result.stats
    # (TP stays inside a node by default: tp <= 8 here.)
    assert s.enumerated == s.pruned_memory + s.pruned_bound + s.duplicates + s.costed > 50_000
    assert s.feasible == s.costed >= len(result) == 5
    assert s.wall_s > 0
    steps = [c.prediction.step_time_s for c in result]
    assert steps == sorted(steps)
    assert "#1 beats #2" in result.why
    assert result.to_dict()["search"]["enumerated"] == s.enumerated


def test_uneven_pipeline_splits_are_in_the_space():
    space = SearchSpace()
    llama = {s.stage_layers for s in splits(126, 16, space)}
    assert (7,) + (8,) * 14 + (7,) in llama  # Llama 3 405B's published split
    deepseek = {(s.first, s.last) for s in splits(61, 16, space)}
    assert (3, 2) in deepseek  # DeepSeek-V3 preset: 3 + 14 x 4 + 2
    even = {s.vp for s in splits(96, 16, space) if s.first is None}
    assert even == {1, 2, 3, 6}
    # Interleaving over uneven stages, by Megatron-core's rules (specs.job.chunk_layers):
    # Llama 3's 7 + 14 x 8 + 7 with chunks of 4, 2 or 1 layers, never vp=3 (8 % 3).
    llama_vps = {s.vp for s in splits(126, 16, space) if (s.first, s.last) == (7, 7)}
    assert llama_vps == {1, 2, 4, 8}
    assert {s.vp for s in splits(126, 16, SearchSpace(interleave=False))} == {1}


def test_interleaved_uneven_plans_are_valid_documents():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x32")
    space = SearchSpace(zero=(1,), sequence_parallel=(False,))
    est = Estimator(model, cluster)
    walk = _Walk(model, cluster, est, space, 64, 4096, "bf16", 1e30, 5)
    seen = 0
    for base, mbs, _, _ in walk._families():
        if base["vp"] > 1 and len(set(base["stage_layers"])) > 1:
            from trainpilot.plan.search import layout_plan

            lay = Layout(zero=1, recompute="none", sequence_parallel=False,
                         micro_batch_size=mbs[0], **base)
            plan = layout_plan(lay, model)
            check_job(model, cluster, plan)  # the spec accepts what the search enumerates
            assert est.quick(lay)[0] > 0
            seen += 1
    assert seen > 0


def test_nothing_fits_reports_the_shortfall():
    model, cluster = load_model("llama3-405b"), load_cluster("h100-sxm-x8")
    result = search(model, cluster, global_batch_size=8, seq_len=8192)
    assert len(result) == 0 and not result
    short = result.shortfall
    assert short is not None and short.short_gib > 0
    assert short.plan["zero"] == 3 and short.plan["recompute"] == "full"
    assert any("more devices" in tip for tip in short.suggestions)
    assert result.stats.pruned_memory == result.stats.enumerated


def test_moe_search_uses_expert_parallelism():
    model, cluster = load_model("mixtral-8x7b"), load_cluster("h100-sxm-x64")
    result = search(model, cluster, global_batch_size=256, seq_len=4096, top=3)
    assert len(result) == 3
    assert any(c.plan.ep > 1 for c in result)


def test_a_precision_no_plan_trains_in_is_a_spec_error():
    # The A100 lists an fp32 peak, so the device check passes; the Plan has no fp32 (it used
    # to surface as pydantic's ValidationError rather than the one-line SpecError).
    model, cluster = load_model("llama3-8b"), load_cluster("a100-80gb-x8")
    with pytest.raises(SpecError, match="precision") as err:
        search(model, cluster, global_batch_size=8, seq_len=2048, precision="fp32")
    assert "bf16, fp16, fp8" in str(err.value)
    with pytest.raises(SpecError, match="lists no"):  # the device's own check still comes first
        search(model, cluster, global_batch_size=8, seq_len=2048, precision="int4")
