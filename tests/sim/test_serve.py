"""Sim2Infer: the serving cost model's terms by hand, its physics, its roofline reasons, and the
validation on published measurements (held-out gate, negative controls)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tests.conftest import run_cli
from trainpilot.perf.flops import count_params
from trainpilot.perf.serve import (
    PassShape,
    ServeEfficiency,
    activation_bytes_per_token,
    kv_bytes_per_token,
    kv_capacity_tokens,
    pass_cost,
    weight_bytes_per_device,
)
from trainpilot.sim import serve_validation
from trainpilot.sim.serve import simulate_serve
from trainpilot.specs import SpecError, load_cluster, load_model
from trainpilot.specs.serve import InstanceLayout, ServePlan, SpeculativeSpec, load_serve_plan

EFF = ServeEfficiency()


def _dtype(weight_dtype: str, **fields) -> ServePlan:
    """A plan that only carries precisions (the lengths do not enter the weights)."""
    return ServePlan(input_len=1, output_len=1, weight_dtype=weight_dtype, **fields)


def test_kv_cache_and_weights_by_hand():
    l70, ds = load_model("llama3-70b"), load_model("deepseek-v3")
    # GQA: 80 layers x K and V x 8/2 heads x 128 x 1 byte under TP2 with an FP8 cache.
    assert kv_bytes_per_token(l70, InstanceLayout(tp=2), "fp8") == 80 * 2 * 4 * 128
    assert kv_bytes_per_token(l70, InstanceLayout(tp=16), "bf16") == 80 * 2 * 1 * 128 * 2
    # MLA: the 512 + 64 latent per layer, the same on every TP rank.
    assert kv_bytes_per_token(ds, InstanceLayout(tp=8), "bf16") == 61 * 576 * 2
    l8 = load_model("llama3-8b")
    bf16 = weight_bytes_per_device(l8, InstanceLayout(), _dtype("bf16"))
    norms = 2 * 4096 * 32 + 4096  # counted by count_params, not stored apart here
    assert bf16 == pytest.approx(2 * (count_params(l8).total - norms), rel=1e-9)
    fp8 = weight_bytes_per_device(l8, InstanceLayout(tp=2), _dtype("fp8"))
    embed = 2 * 128256 * 4096 * 2 / 2
    assert fp8 == pytest.approx(embed + (bf16 - 2 * 128256 * 4096 * 2) / 4, rel=1e-9)
    # DeepSeek-V3 at EP144 with 32 redundant experts: 2 routed experts per device per layer.
    per_dev = weight_bytes_per_device(ds, InstanceLayout(dp_attention=144, ep=144,
                                                         num_redundant_experts=32),
                                      _dtype("fp8"))
    assert 20 * 2**30 < per_dev < 26 * 2**30


def test_largest_batch_follows_memory():
    l70 = load_model("llama3-70b")
    plan = ServePlan(decode=InstanceLayout(tp=2), input_len=1000, output_len=1000,
                     weight_dtype="fp8", kv_dtype="fp8")
    h100 = simulate_serve(l70, load_cluster("h100-sxm-x8"), plan, EFF)
    h200 = simulate_serve(l70, load_cluster("h200-x8"), plan, EFF)
    bf16_kv = simulate_serve(l70, load_cluster("h100-sxm-x8"), plan.replace(kv_dtype="bf16"),
                             EFF)
    assert h100.largest_batch == int(h100.kv_capacity_tokens // 2000)
    assert h200.largest_batch > 2 * h100.largest_batch  # 141 GB vs 80 GB, same weights
    assert bf16_kv.largest_batch == pytest.approx(h100.largest_batch / 2, abs=1)
    with pytest.raises(SpecError, match="no room for one sequence"):
        simulate_serve(load_model("llama3-405b"), load_cluster("h100-sxm-x8"),
                       ServePlan(decode=InstanceLayout(tp=2), input_len=10, output_len=10), EFF)


def test_roofline_reason_per_phase():
    l70, l8 = load_model("llama3-70b"), load_model("llama3-8b")
    h100 = load_cluster("h100-sxm-x8")
    plan = ServePlan(input_len=4096, output_len=256, weight_dtype="fp8", kv_dtype="fp8")

    def reason(model, layout, shape, p=plan):
        return pass_cost(model, h100, p, layout, shape, EFF).reason

    one = PassShape(decode_seqs=1, decode_rows=1, context=4096)
    assert reason(l70, InstanceLayout(tp=2), one) == "hbm_weights"
    prompt = PassShape(prefill_rows=8192, prefill_pairs=2 * 4096 * 4097 / 2, prefill_seqs=2)
    assert reason(l70, InstanceLayout(tp=2), prompt) == "compute"
    long_ctx = PassShape(decode_seqs=64, decode_rows=64, context=32768)
    assert reason(l8, InstanceLayout(), long_ctx) == "hbm_kv"
    ds, h800 = load_model("deepseek-v3"), load_cluster("h800-x144")
    ep = InstanceLayout(dp_attention=144, ep=144, num_redundant_experts=32)
    dec = PassShape(decode_seqs=128, decode_rows=128, context=4096)
    no_tbo = ServePlan(input_len=4096, output_len=2, weight_dtype="fp8")
    cost = pass_cost(ds, h800, no_tbo, ep, dec, EFF)
    tbo = pass_cost(ds, h800, no_tbo.replace(two_batch_overlap=True), ep, dec, EFF)
    assert cost.seconds["all_to_all"] > 0.3 * cost.total_s  # 144 GPUs over InfiniBand
    assert tbo.seconds["all_to_all"] < 0.5 * cost.seconds["all_to_all"]  # hidden by overlap
    tp8 = pass_cost(l70, h100, plan, InstanceLayout(tp=8), one, EFF)
    assert tp8.seconds["tp_collectives"] > 0


def test_batch_trades_latency_for_throughput_and_mtp_helps_small_batches():
    l70, h200 = load_model("llama3-70b"), load_cluster("h200-x8")
    base = ServePlan(input_len=1000, output_len=1000, weight_dtype="fp8", kv_dtype="fp8",
                     batching="static")
    small = simulate_serve(l70, h200, base.replace(batch_size=8), EFF)
    large = simulate_serve(l70, h200, base.replace(batch_size=64), EFF)
    assert large.tpot_s > small.tpot_s
    assert large.output_tokens_per_s_per_device > 4 * small.output_tokens_per_s_per_device
    mtp = base.replace(batch_size=8, speculative=SpeculativeSpec(num_draft_tokens=1,
                                                                 acceptance=0.8))
    assert SpeculativeSpec(num_draft_tokens=2, acceptance=0.5).tokens_per_step == 1.75
    assert simulate_serve(l70, h200, mtp, EFF).tpot_s < 0.65 * small.tpot_s  # memory-bound


def test_disaggregated_ttft_includes_the_kv_transfer():
    ds, h800 = load_model("deepseek-v3"), load_cluster("h800-x176")
    plan = load_serve_plan("deepseek-v3-pd-ep144")
    report = simulate_serve(ds, h800, plan, EFF)
    transfer = plan.input_len * 61 * 576 * 2 / h800.network.inter_node.bytes_per_s
    assert report.ttft_s == pytest.approx(report.phases["prefill"].total_s + transfer)
    assert set(report.phases) == {"prefill", "decode"}
    assert report.batch_size == report.largest_batch > 0


def test_bad_plans_name_the_field():
    with pytest.raises(ValueError, match=r"ep: got 3; does not divide"):
        InstanceLayout(tp=4, ep=3)
    with pytest.raises(SpecError, match="decode.tp"):
        simulate_serve(load_model("llama3-8b"), load_cluster("h100-sxm-x8"),
                       ServePlan(decode=InstanceLayout(tp=3), input_len=8, output_len=8), EFF)
    with pytest.raises(SpecError, match="decode.ep"):
        simulate_serve(load_model("deepseek-v3"), load_cluster("h800-x144"),
                       ServePlan(decode=InstanceLayout(dp_attention=72, ep=72), input_len=8,
                                 output_len=8), EFF)
    with pytest.raises(ValueError, match="batch_size"):
        ServePlan(decode=InstanceLayout(dp_attention=4, ep=4), input_len=8, output_len=8,
                  batch_size=6)
    with pytest.raises(SpecError, match="serve plan"):
        load_serve_plan("no-such-plan")


def test_held_out_error_is_gated_and_reported():
    """>= 10 held-out rows from >= 4 sources; each held-out batch's mean |error| under its
    committed gate. Whether the issue's target (15%) is met is reported as measured, not
    assumed."""
    summary = serve_validation.summarize(serve_validation.run())
    held, cal = summary["held_out"], summary["calibration"]
    assert held["rows"] >= 10 and held["num_sources"] >= 4
    for batch, row in summary["held_out_batches"].items():
        assert row["mean_abs_error"] <= serve_validation.HELD_OUT_GATES[batch]
    assert summary["passed"] and not summary["failed_batches"]
    assert cal["mean_abs_error"] < 0.08
    assert summary["target_met"] == (held["mean_abs_error"] <= 0.15)


def test_the_gate_can_fail():
    """Negative controls: less than half the KV-streaming bandwidth, or every row costed as
    if served by today's kernels (no runtime profiles), pushes the held-out error past the
    gate."""
    bad = serve_validation.calibrated_efficiency().replace(hbm_efficiency=0.4)
    assert not serve_validation.summarize(serve_validation.run(bad))["passed"]
    current = [dataclasses.replace(c, plan=c.plan.replace(runtime={}))
               for c in serve_validation.load_cases()]
    summary = serve_validation.summarize(serve_validation.run(cases=current))
    assert not summary["passed"] and 1 in summary["failed_batches"]
    # A new batch scored without a committed gate fails until one is committed.
    extra = [dataclasses.replace(c, batch=99) for c in serve_validation.load_cases()
             if c.split == "held_out"][:3]
    summary = serve_validation.summarize(serve_validation.run(
        cases=serve_validation.load_cases() + extra))
    assert summary["failed_batches"] == [99] and summary["gates"][99] is None


def test_calibration_reads_only_calibration_rows(monkeypatch):
    seen = set()
    real = serve_validation.predict

    def spy(case, eff):
        seen.add(case.split)
        return real(case, eff)

    monkeypatch.setattr(serve_validation, "predict", spy)
    cases = [c for c in serve_validation.load_cases() if c.source == "lmsys-large-scale-ep"
             or c.split == "held_out"]
    serve_validation.calibrate(cases)
    assert seen == {"calibration"}


def test_every_row_cites_its_source():
    from importlib import resources

    import yaml

    text = resources.files("trainpilot.sim").joinpath("data", "serve_validation.yaml").read_text()
    for name, block in yaml.safe_load(text)["sources"].items():
        assert block["url"].startswith("https://") and block["licence"] and block["how"], name
    with pytest.raises(SpecError, match="unknown key"):
        import tempfile
        from pathlib import Path

        path = Path(tempfile.mkdtemp()) / "bad.yaml"
        path.write_text("sources:\n  x:\n    split: held_out\n    colour: red\n    cases: []\n")
        serve_validation.load_cases(path)


def test_cli_serve_json_and_validate():
    result = run_cli("simulate", "serve", "--model", "deepseek-v3", "--cluster", "h800-x176",
                     "--plan", "deepseek-v3-pd-ep144", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("ttft_s", "tpot_s", "output_tokens_per_s_per_device", "largest_batch",
                "kv_capacity_tokens", "phases", "deployment"):
        assert key in data, key
    assert data["phases"]["decode"]["reason"] in ("compute", "hbm_weights", "all_to_all")
    assert math.isclose(data["deployment"]["devices"], 176)
    result = run_cli("simulate", "serve", "--validate")
    assert result.returncode == 0, result.stderr
    assert "held-out mean |error|" in result.stdout and "target <= 15%" in result.stdout
    bad = run_cli("simulate", "serve", "--model", "llama3-8b", "--cluster", "h100-sxm-x8",
                  "--plan", "input_len=8,output_len=8", "--tp", "3")
    assert bad.returncode == 2 and bad.stderr.startswith("error: decode.tp: got 3")


def test_later_batches_are_held_out_and_scored_apart(tmp_path):
    """A later batch (collected blind, to test) is held out only and must say the batch its
    file holds; the summary scores each held-out batch apart as well as pooled."""
    source = ("sources:\n  s:\n    title: t\n    url: https://example.org\n    licence: x\n"
              "    how: h\n    split: {split}\n    batch: {batch}\n    defaults: {{}}\n"
              "    cases: []\n")
    path = tmp_path / "b.yaml"
    path.write_text(source.format(split="calibration", batch=2))
    with pytest.raises(SpecError, match="held_out only"):
        serve_validation.load_cases(path, batch=2)
    path.write_text(source.format(split="held_out", batch=3))
    with pytest.raises(SpecError, match="holds batch 2"):
        serve_validation.load_cases(path, batch=2)
    assert serve_validation.load_cases(path) == []

    held = [c for c in serve_validation.load_cases() if c.split == "held_out" and c.batch == 1]
    later = [dataclasses.replace(c, source=c.source + "-again", batch=2) for c in held[:3]]
    summary = serve_validation.summarize(serve_validation.run(cases=held + later))
    by_batch = summary["held_out_batches"]
    assert {b: row["rows"] for b, row in by_batch.items()} == {1: len(held), 2: 3}
    assert summary["held_out"]["rows"] == len(held) + 3
    assert "batch 2 (blind)" in serve_validation.batches_line(summary)


def test_fp4_gemms_use_fp4_tensor_cores_only_where_the_device_has_them():
    """A compute-bound prefill: 4-bit weights on B200 (NVFP4 tensor cores, 2x the FP8 rate)
    take clearly less time than FP8; on H200, which has no FP4 tensor cores, the GEMMs run at
    the FP8 rate (W4A8), so the prefill takes about as long."""
    model = load_model("llama3-70b")

    def ttft(cluster: str, dtype: str) -> float:
        plan = ServePlan(input_len=8192, output_len=1, batch_size=8, batching="static",
                         weight_dtype=dtype, kv_dtype="fp8", decode=InstanceLayout(tp=2))
        return simulate_serve(model, load_cluster(cluster), plan).ttft_s

    assert ttft("b200-x8", "fp4") < 0.7 * ttft("b200-x8", "fp8")
    assert ttft("h200-x8", "fp4") > 0.9 * ttft("h200-x8", "fp8")


def test_fewer_sequences_than_attention_groups_are_paced_by_a_busy_group():
    """4 requests on 8 DP-attention ranks: half the ranks idle, each pass as long as one with a
    sequence on every rank (the busiest rank paces it), so half the throughput of 8. Before,
    the capped batch (4) was compared with the 8 groups and refused as "no room" for the
    weights, and a fractional half-sequence per rank would have halved the attention's cost."""
    ds, h200 = load_model("deepseek-v3"), load_cluster("h200-x8")
    plan = ServePlan(decode=InstanceLayout(dp_attention=8, ep=8), input_len=3200,
                     output_len=800, weight_dtype="fp8")
    four = simulate_serve(ds, h200, plan.replace(max_batch_size=4), EFF)
    eight = simulate_serve(ds, h200, plan.replace(max_batch_size=8), EFF)
    assert four.batch_size == 4 and eight.batch_size == 8
    assert four.tpot_s == pytest.approx(eight.tpot_s, rel=1e-12)
    assert four.output_tokens_per_s_per_instance == pytest.approx(
        eight.output_tokens_per_s_per_instance / 2, rel=1e-12)
    # Still refused when the weights leave no room for one sequence.
    with pytest.raises(SpecError, match="no room"):
        simulate_serve(ds, h200, plan.replace(input_len=2_000_000, output_len=1), EFF)


def test_serving_bias_counts_a_latency_as_an_inverse_speed():
    """A TTFT predicted at half the measured is optimistic (+100% in speed), like a throughput
    predicted at twice the measured."""
    import dataclasses

    from trainpilot.sim.serve_validation import ServeResult, _bundled_cases, summarize

    cases = _bundled_cases()
    ttft = next(c for c in cases if c.metric == "ttft_ms")
    rate = dataclasses.replace(next(c for c in cases if c.metric.startswith("output_tokens")),
                               source=ttft.source)
    results = [ServeResult(ttft, ttft.measured * 0.5, None),
               ServeResult(rate, rate.measured * 2.0, None)]
    assert [r.speed_error for r in results] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert summarize(results)["sources"][ttft.source]["bias"] == pytest.approx(1.0)


def test_meta_fp8_checkpoints_keep_attention_and_the_end_layers_16_bit():
    """Meta's Llama 3.1 FP8 checkpoints (llama-models' fp8_mixed: only the MLPs of layers 1 to
    n-2 in FP8) hold more bytes per device than an everything-FP8 reading of the same model,
    by exactly the attention of the 124 inner layers and the two end layers' MLPs at one
    extra byte per weight; and a small-batch decode, which streams the weights, is slower by
    about the same ratio. Before, ``weight_dtype`` covered every linear map."""
    from trainpilot.perf.flops import attention_params, mlp_params

    l405 = load_model("llama3-405b")
    layout = InstanceLayout(tp=8)
    everything = _dtype("fp8")
    meta = _dtype("fp8", quantized_modules="mlp", unquantized_end_layers=1)
    extra = (124 * attention_params(l405) + 2 * (attention_params(l405)
                                                 + mlp_params(l405, l405.ffn_size))) / 8
    assert (weight_bytes_per_device(l405, layout, meta)
            - weight_bytes_per_device(l405, layout, everything)) == pytest.approx(extra, rel=1e-9)
    assert meta.weight_bytes("attention", 5, 126) == 2.0
    assert meta.weight_bytes("mlp", 5, 126) == 1.0
    assert meta.weight_bytes("mlp", 0, 126) == meta.weight_bytes("mlp", 125, 126) == 2.0
    h100 = load_cluster("h100-sxm-x8")

    def tpot(plan: ServePlan) -> float:
        return simulate_serve(l405, h100, plan.replace(
            decode=layout, input_len=128, output_len=2048, batch_size=4,
            batching="static"), EFF).tpot_s

    ratio = weight_bytes_per_device(l405, layout, meta) / weight_bytes_per_device(
        l405, layout, everything)
    assert tpot(meta) / tpot(everything) == pytest.approx(ratio, rel=0.1)
    assert tpot(meta) > 1.1 * tpot(everything)


def test_a_total_memory_basis_and_a_profiled_pass_size_the_kv_cache_as_vllm_does():
    """vLLM sizes its cache as total HBM x gpu_memory_utilization minus the weights and the
    peak of a profiling pass of max_num_batched_tokens tokens; TensorRT-LLM takes a fraction of
    what is left after the weights. By hand for Llama 3.1 405B (Meta's FP8) on 8 H100 80GB:
    the 91,680-token profiling pass of a run without chunked prefill leaves room for one
    34,832-token sequence, the fraction of the free memory for six."""
    from trainpilot.perf.hardware import curve_for

    l405, h100 = load_model("llama3-405b"), load_cluster("h100-sxm-x8")
    layout = InstanceLayout(tp=8)
    plan = ServePlan(decode=layout, input_len=32784, output_len=2048, weight_dtype="fp8",
                     quantized_modules="mlp", unquantized_end_layers=1, kv_mem_fraction=0.9)
    vllm = plan.replace(kv_mem_basis="total", profile_tokens=91680)
    hbm = h100.device.hbm_gib * 2**30
    weights = weight_bytes_per_device(l405, layout, plan)
    reserved = curve_for(h100).reserved_gib * 2**30
    # The MLP's peak: residual and normed input (2 x 16,384) and 3 x 53,248 / 8, 16-bit.
    assert activation_bytes_per_token(l405, layout) == 2 * (2 * 16384 + 3 * 53248 / 8)
    by_hand = (0.9 * hbm - weights - reserved
               - 91680 * activation_bytes_per_token(l405, layout)) / (126 * 2 * 128 * 2)
    assert kv_capacity_tokens(l405, h100, vllm, layout, EFF) == pytest.approx(by_hand, rel=1e-9)
    free = kv_capacity_tokens(l405, h100, plan, layout, EFF)
    assert free == pytest.approx((hbm - weights - reserved - EFF.workspace_gib * 2**30) * 0.9
                                 / (126 * 2 * 128 * 2), rel=1e-9)
    assert simulate_serve(l405, h100, vllm, EFF).largest_batch == 1
    assert simulate_serve(l405, h100, plan, EFF).largest_batch >= 4


def test_an_engine_that_admits_on_current_length_runs_more_sequences():
    """vLLM and SGLang admit a sequence on the blocks it holds and preempt when the cache fills:
    a continuous batch then holds input + output / 2 tokens per sequence on average, where an
    engine that reserves the whole length (TensorRT-LLM's GUARANTEED_NO_EVICT) holds input +
    output; a static batch grows in step, so it reserves the whole length either way."""
    l70, h100 = load_model("llama3-70b"), load_cluster("h100-sxm-x8")
    plan = ServePlan(decode=InstanceLayout(tp=2), input_len=2048, output_len=2048,
                     weight_dtype="fp8")
    full = simulate_serve(l70, h100, plan, EFF)
    current = simulate_serve(l70, h100, plan.replace(kv_admission="current"), EFF)
    assert full.largest_batch == int(full.kv_capacity_tokens // 4096)
    assert current.largest_batch == int(current.kv_capacity_tokens // 3072)
    assert current.largest_batch > 1.3 * full.largest_batch
    static = plan.replace(batching="static")
    assert simulate_serve(l70, h100, static.replace(kv_admission="current"),
                          EFF).largest_batch == simulate_serve(l70, h100, static,
                                                               EFF).largest_batch


def test_the_cli_takes_the_engine_s_memory_and_precision_fields():
    """The vLLM / Meta FP8 fields from the command line give the same KV capacity as the plan
    document that sets them; a bad value is one line and exit 2."""
    base = ["simulate", "serve", "--model", "llama3-405b", "--cluster", "h100-sxm-x8",
            "--plan", "decode.tp=8,input_len=2048,output_len=2048,weight_dtype=fp8", "--json"]
    flags = ["--quantized-modules", "mlp", "--unquantized-end-layers", "1", "--kv-mem-basis",
             "total", "--profile-tokens", "91680", "--kv-admission", "current"]
    cli = run_cli(*base, *flags)
    assert cli.returncode == 0, cli.stderr
    plan = ServePlan(decode=InstanceLayout(tp=8), input_len=2048, output_len=2048,
                     weight_dtype="fp8", quantized_modules="mlp", unquantized_end_layers=1,
                     kv_mem_basis="total", profile_tokens=91680, kv_admission="current")
    report = simulate_serve(load_model("llama3-405b"), load_cluster("h100-sxm-x8"), plan,
                            serve_validation.calibrated_efficiency())
    data = json.loads(cli.stdout)
    assert data["kv_capacity_tokens"] == pytest.approx(report.kv_capacity_tokens, rel=1e-9)
    assert data["largest_batch"] == report.largest_batch == int(
        report.kv_capacity_tokens // (2048 + 1024))
    bad = run_cli(*base, "--kv-admission", "sometimes")
    assert bad.returncode == 2 and "--kv-admission" in bad.stderr


def test_unmixed_batching_prefills_in_passes_of_their_own():
    """An engine that does not mix prompt tokens into decode passes (vLLM's V0 engine with MLA,
    SGLang without mixed chunks) pays one prefill pass per batch of prompts plus the decode
    steps, as a static batch does, but admits on the running length as continuous batching
    does; a mixed pass instead carries prompt rows into every decode step, which for MoE
    touches more experts per step."""
    ds, h200 = load_model("deepseek-v3"), load_cluster("h200-x8")
    base = ServePlan(decode=InstanceLayout(tp=8), input_len=3200, output_len=800,
                     weight_dtype="fp8", max_batch_size=4, kv_admission="current",
                     runtime="triton-moe-2025")
    unmixed = simulate_serve(ds, h200, base.replace(batching="unmixed"), EFF)
    static = simulate_serve(ds, h200, base.replace(batching="static"), EFF)
    mixed = simulate_serve(ds, h200, base, EFF)
    assert set(unmixed.phases) == {"prefill", "decode"} and set(mixed.phases) == {"mixed"}
    assert unmixed.output_tokens_per_s_per_instance == pytest.approx(
        static.output_tokens_per_s_per_instance)
    total = unmixed.phases["prefill"].total_s + 800 * unmixed.phases["decode"].total_s
    assert unmixed.output_tokens_per_s_per_instance == pytest.approx(4 * 800 / total)
    # Four decode rows touch ~12% of the experts; with four prompt rows each mixed in, ~47%.
    assert unmixed.tpot_s < 0.7 * mixed.tpot_s
    assert unmixed.output_tokens_per_s_per_instance > 1.3 * mixed.output_tokens_per_s_per_instance
    # Admission on the running length, as continuous batching (a static batch reserves it all).
    wide = base.replace(max_batch_size=None)
    assert simulate_serve(ds, h200, wide.replace(batching="unmixed"), EFF).largest_batch == \
        simulate_serve(ds, h200, wide, EFF).largest_batch > \
        simulate_serve(ds, h200, wide.replace(batching="static"), EFF).largest_batch
    cli = run_cli("simulate", "serve", "--model", "deepseek-v3", "--cluster", "h200-x8",
                  "--plan", "decode.tp=8,input_len=3200,output_len=800,weight_dtype=fp8,"
                  "max_batch_size=4,kv_admission=current,runtime=triton-moe-2025",
                  "--batching", "unmixed", "--uncalibrated", "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["output_tokens_per_s_per_instance"] == pytest.approx(
        unmixed.output_tokens_per_s_per_instance)


def test_host_time_per_pass_is_paid_by_every_prefill_and_decode_pass():
    """A runtime's ``host_step_ms`` adds to each forward pass exactly once: a static batch of one
    sequence pays it in its prefill (TTFT) and in each decode step (TPOT)."""
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x8")
    base = ServePlan(input_len=32, output_len=128, batching="static", batch_size=1,
                     weight_dtype="bf16", kv_dtype="bf16")
    slow = base.replace(runtime=dict(name="slow-host", host_step_ms=2.0))
    fast_r, slow_r = simulate_serve(model, cluster, base, EFF), simulate_serve(
        model, cluster, slow, EFF)
    assert slow_r.tpot_s - fast_r.tpot_s == pytest.approx(2e-3, rel=1e-6)
    assert slow_r.ttft_s - fast_r.ttft_s == pytest.approx(2e-3, rel=1e-6)
    assert slow_r.phases["decode"].seconds["overhead"] > fast_r.phases["decode"].seconds[
        "overhead"]
    with pytest.raises(SpecError, match="host_step_ms"):
        load_serve_plan(dict(input_len=1, output_len=1,
                             runtime=dict(name="x", host_step_ms=-1.0)))


def test_vllm_v0_host_time_is_what_its_calibration_source_measured():
    """The vllm-v0 profile's host time is the fit on its calibration source (vLLM PR #10933:
    Llama-3-8B at batch 1 on main, 0.970 s for 32 in / 128 out), to the 0.05 ms it is rounded
    to; no held-out row enters the fit; the GPU-side calibration leaves that row out. Negative
    controls: the same row costed without host time is >10% optimistic, and a row measured at
    the host-free prediction fits 0."""
    from trainpilot.specs.serve import RUNTIME_PRESETS, VLLM_V0_HOST_STEP_MS

    cases = serve_validation.load_cases()
    fitted = serve_validation.fit_host_step("vllm-v0", cases=cases)
    assert abs(fitted - VLLM_V0_HOST_STEP_MS) <= 0.05
    assert RUNTIME_PRESETS["vllm-v0"]["host_step_ms"] == VLLM_V0_HOST_STEP_MS
    assert RUNTIME_PRESETS["vllm-v0-triton-moe"]["host_step_ms"] == VLLM_V0_HOST_STEP_MS
    (row,) = [c for c in cases if c.source == "vllm-pr10933"]
    assert row.split == "calibration"
    eff = serve_validation.calibrated_efficiency()
    bare = dataclasses.replace(row, plan=row.plan.replace(runtime={}))
    assert serve_validation.predict(bare, eff).error > 0.10
    assert abs(serve_validation.predict(row, eff).error) < 0.01
    at_model = dataclasses.replace(row, measured=serve_validation.predict(
        dataclasses.replace(row, plan=row.plan.replace(
            runtime=dict(name="vllm-v0", host_step_ms=0.0))), eff).predicted)
    assert serve_validation.fit_host_step("vllm-v0", eff, [at_model]) == pytest.approx(
        0.0, abs=1e-6)
    held = [c for c in cases if c.split == "held_out"] + [row]
    seen = []
    real = serve_validation.predict

    def spy(case, eff):
        seen.append(case.split)
        return real(case, eff)

    import unittest.mock

    with unittest.mock.patch.object(serve_validation, "predict", spy):
        serve_validation.fit_host_step("vllm-v0", eff, held)
    assert set(seen) == {"calibration"}
    with pytest.raises(SpecError, match="no calibration row"):
        serve_validation.fit_host_step("trtllm-0.5", eff, held)
    assert serve_validation.host_step_fits(eff, cases) == {"vllm-v0": pytest.approx(fitted)}
    # The GPU-side fit never reads a row whose runtime carries host time.
    gpu_rows = [c for c in cases if c.split == "calibration" and not
                c.plan.runtime.host_step_ms]
    assert row not in gpu_rows and len(gpu_rows) == 66


def test_the_shipped_calibration_is_what_the_calibration_procedure_gives():
    """``data/serve_calibration.yaml`` holds what ``calibrate`` fits today (to its 4 decimals):
    a cost-model change that moves the calibration rows must refit it (it once stayed at an
    older model's values for a day of changes). Negative control: a file value off by 0.05
    is caught."""
    fitted, _ = serve_validation.calibrate()
    shipped = serve_validation.calibrated_efficiency()
    for name in serve_validation.FITTED:
        assert getattr(fitted, name) == pytest.approx(getattr(shipped, name), abs=2e-4), name
    stale = shipped.replace(kernel_gap_us=shipped.kernel_gap_us + 0.05)
    assert stale.kernel_gap_us != pytest.approx(fitted.kernel_gap_us, abs=2e-4)
