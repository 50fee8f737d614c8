"""Rich tables for predictions and search results (the CLI verbs and the demo print these)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from trainpilot.perf.predict import BREAKDOWN_KEYS, MEMORY_KEYS, Prediction
from trainpilot.plan.search import SearchResult, describe

_SHORT = {"compute": "compute", "recompute": "recomp", "tp_comm": "TP", "pp_comm": "PP xfer",
          "pp_bubble": "bubble", "dp_comm_exposed": "DP", "ep_comm": "EP", "cp_comm": "CP",
          "optimizer": "optim"}


def summary_table(pred: Prediction, title: str = "prediction") -> Table:
    """Step time, throughput, MFU/HFU and memory verdict of one prediction."""
    table = Table(show_header=False, title=title, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    mem = pred.memory_gib
    fits = "[green]yes[/]" if pred.fits else "[bold red]no[/]"
    rows = [("layout", describe(pred.plan)),
            ("step time", f"{pred.step_time_s:.3f} s ({pred.num_micro_batches} micro-batches)"),
            ("tokens / s", f"{pred.tokens_per_s:,.0f}"),
            ("model TFLOP/s per device", _conventions(pred, "tflops_per_device", ".1f")),
            ("MFU / HFU", f"{_conventions(pred, 'mfu', '.1%')} / HFU {pred.hfu:.1%}"),
            ("peak memory", f"{mem['peak']:.1f} GiB on stage {mem['peak_stage']} of "
                            f"{mem['hbm']:.0f} GiB; fits: {fits}")]
    for key, value in rows:
        table.add_row(key, value)
    return table


def breakdown_table(pred: Prediction) -> Table:
    """Seconds per step by part (they sum to the step time) and each part's share."""
    table = Table(title="where the step goes (s; parts sum to the step)", title_justify="left")
    for col in ("part", "seconds", "share"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for key in BREAKDOWN_KEYS:
        value = pred.breakdown_s[key]
        if value > 0:
            table.add_row(key, f"{value:.3f}", f"{value / pred.step_time_s:.1%}")
    table.add_row("[bold]step[/]", f"[bold]{pred.step_time_s:.3f}[/]", "100%")
    return table


def memory_table(pred: Prediction, max_rows: int = 8) -> Table:
    """Per-stage memory (GiB); long pipelines show the first, the peak and the last stages."""
    stages = pred.memory_gib["per_stage"]
    peak = pred.memory_gib["peak_stage"]
    keep = list(range(len(stages)))
    if len(stages) > max_rows:
        keep = sorted({0, 1, peak, len(stages) - 2, len(stages) - 1})
    table = Table(title="memory per device by pipeline stage (GiB)", title_justify="left")
    table.add_column("stage", justify="right")
    table.add_column("layers", justify="right")
    for key in MEMORY_KEYS:
        table.add_column(key, justify="right")
    for i in keep:
        row = stages[i]
        mark = " *" if i == peak else ""
        table.add_row(f"{i}{mark}", str(pred.stages[i].layers),
                      *(f"{row[k]:.2f}" for k in MEMORY_KEYS))
    if len(keep) < len(stages):
        table.caption = f"{len(stages) - len(keep)} middle stages like stage 1 not shown; * peak"
    return table


def placement_table(pred: Prediction) -> Table:
    """Where each parallel group lies on the cluster tree."""
    table = Table(title=f"placement (rank order, innermost first: "
                        f"{', '.join(pred.placement['order'])})", title_justify="left")
    for col in ("group", "size", "per node", "nodes", "racks", "tier"):
        table.add_column(col, justify="left" if col in ("group", "tier") else "right")
    for name, span in pred.placement["groups"].items():
        if name == "expert_dp" and pred.plan.ep == 1:
            continue  # the same ranks as dp
        if span["size"] > 1:
            table.add_row(name, str(span["size"]), str(span["per_node"]), str(span["nodes"]),
                          str(span["racks"]), span["tier"])
    return table


def rank_map_table(pred: Prediction, limit: int) -> Table:
    table = Table(title=f"rank -> (rack, node, device), first {limit} ranks",
                  title_justify="left")
    for col in ("rank", "rack", "node", "device", "tp", "cp", "dp", "pp"):
        table.add_column(col, justify="right")
    for row in pred.rank_map(limit):
        table.add_row(*(str(row[c]) for c in ("rank", "rack", "node", "device", "tp", "cp",
                                             "dp", "pp")))
    return table


def caveat_lines(pred: Prediction) -> str:
    if not pred.caveats:
        return "inside the calibrated regime (see `trainpilot validate`)"
    return "caveats: " + "; ".join(pred.caveats)


def print_prediction(console: Console, pred: Prediction, *, ranks: int = 0) -> None:
    console.print(summary_table(pred))
    console.print(breakdown_table(pred))
    console.print(memory_table(pred))
    console.print(placement_table(pred))
    if ranks:
        console.print(rank_map_table(pred, ranks))
    console.print(caveat_lines(pred), style="dim")


def compact(plan) -> str:
    """'t8 p16 v2 d8 mb1 z1 full sp' for narrow tables."""
    return describe(plan, short=True)


def ranking_table(result: SearchResult) -> Table:
    """The top plans: layout, step time, throughput, MFU and peak memory."""
    table = Table(title=f"top {len(result)} plans: {result.model.name} on {result.cluster.name}, "
                        f"batch {result.global_batch_size} x {result.seq_len} tokens",
                  title_justify="left", caption="t=tp p=pp[first|last layers] v=vp d=dp "
                  "e=ep etp=expert TP (parallel folding) c=cp mb=micro-batch z=ZeRO, recompute, "
                  "sp=sequence parallel, i=devices left idle (MFU over the devices used)",
                  caption_justify="left")
    table.add_column("#", justify="right")
    table.add_column("layout", no_wrap=True)
    for col in ("step s", "tokens/s", "MFU", "peak GiB"):
        table.add_column(col, justify="right")
    for cand in result:
        p = cand.prediction
        table.add_row(str(cand.rank), compact(cand.plan), f"{p.step_time_s:.2f}",
                      f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.memory_gib['peak']:.1f}")
    return table


def ranking_breakdown_table(result: SearchResult) -> Table:
    """Seconds per step by part for each ranked plan (only parts some plan spends on)."""
    shown = [k for k in BREAKDOWN_KEYS if any(c.prediction.breakdown_s[k] > 0 for c in result)]
    table = Table(title="where each plan's step goes (s)", title_justify="left")
    table.add_column("#", justify="right")
    for key in shown:
        table.add_column(_SHORT[key], justify="right")
    for cand in result:
        table.add_row(str(cand.rank),
                      *(f"{cand.prediction.breakdown_s[k]:.2f}" for k in shown))
    return table


def stats_line(result: SearchResult) -> str:
    s = result.stats
    return (f"searched {s.enumerated:,} layouts in {s.wall_s:.2f} s: {s.pruned_memory:,} did not "
            f"fit in memory, {s.pruned_bound:,} were bounded out (could not reach the top "
            f"{len(result) or 'N'}), "
            + (f"{s.duplicates:,} were a lower ZeRO stage's plan again, " if s.duplicates else "")
            + f"{s.costed:,} were costed ({s.feasible:,} fit); "
            f"headroom {result.headroom:.0%} of HBM")


def print_search(console: Console, result: SearchResult) -> None:
    if result:
        console.print(ranking_table(result))
        console.print(ranking_breakdown_table(result))
        console.print(result.why)
        best = result[0].prediction
        console.print(memory_table(best))
        console.print("#1 " + caveat_lines(best), style="dim")
    console.print(stats_line(result), style="dim")


def _conventions(pred, key: str, fmt: str) -> str:
    """A figure in both FLOP conventions, named: full s x s attention (Megatron until 2025-03)
    and causal attention counted once (Megatron since, torchtitan)."""
    found = pred.flops or {}
    if "megatron_causal" not in found:
        return format(getattr(pred, key), fmt)
    full, causal = found["megatron_full"][key], found["megatron_causal"][key]
    return f"{format(full, fmt)} (full-square count), {format(causal, fmt)} (causal count)"
