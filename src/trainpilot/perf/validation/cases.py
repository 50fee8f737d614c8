"""Validation cases: each published or measured row as the three job documents, the measured
value, what it is (metric and FLOP convention) and its split.

Splits, by source:

* calibration: the vTrain rows with an even row index (0-based, file order) in each of its two
  CSVs, the only rows the A100 efficiency data was fitted to;
* development: the sources the cost model was built and checked against before issue 14
  (Narayanan et al. 2021, Korthikanti et al. 2022, Llama 3 405B, the odd vTrain rows): nothing
  was fitted to them, but they were seen while the model was written;
* held_out: every source in ``sources/`` (``sources.py``), added in issue 14 and never used to
  fit anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainpilot.perf.memory import layer_rank_params
from trainpilot.perf.options import CostOptions
from trainpilot.perf.validation import vtrain
from trainpilot.perf.validation.sources import load_sources
from trainpilot.specs import (
    ClusterSpec,
    CommOptions,
    ModelSpec,
    Plan,
    RuntimeProfile,
    load_cluster,
    load_model,
)

CALIBRATION, DEVELOPMENT, HELD_OUT = "calibration", "development", "held_out"
SPLITS = (CALIBRATION, DEVELOPMENT, HELD_OUT)
NO_OPTIONS = CostOptions()
# The software of 2021-2022 Megatron(-DeepSpeed): unfused attention, dropout 0.1, no overlap.
LEGACY_RUNTIME = RuntimeProfile(stack="megatron-legacy")


@dataclass(frozen=True, kw_only=True)
class Case:
    """One row to predict. ``metric`` is what ``measured`` is: step_time_s,
    tokens_per_s_per_gpu, tflops_per_gpu (in the FLOP ``convention`` named, see
    ``perf.flops.CONVENTIONS``), weights_optimizer_gib or activations_gib. ``free``: plan
    fields the source does not publish, chosen by the model (the fastest that fits)."""

    dataset: str
    label: str
    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    metric: str
    measured: float
    split: str
    source: str
    options: CostOptions = NO_OPTIONS
    convention: str | None = None
    free: tuple[str, ...] = ()
    batch: int = 1  # held-out sources: the collection they came in (sources.Source.batch)

    @property
    def kind(self) -> str:
        """dense or moe."""
        return "moe" if self.model.is_moe else "dense"


@lru_cache(maxsize=1)
def published() -> dict[str, Any]:
    text = resources.files("trainpilot.perf.validation").joinpath("published.yaml").read_text()
    return yaml.safe_load(text)


@cache
def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelSpec:
    """A Megatron GPT: learned positions, LayerNorm, biased linears, GELU MLP of width 4h."""
    return ModelSpec(name=f"gpt-{layers}x{hidden}", num_hidden_layers=layers, hidden_size=hidden,
                     num_attention_heads=heads, intermediate_size=4 * hidden, vocab_size=vocab,
                     activation="gelu", norm="layernorm", bias=True,
                     position_embedding="learned", max_position_embeddings=seq)


@cache
def a100_cluster(gpus: int, inter_node_gbytes: float | None = None) -> ClusterSpec:
    cluster = load_cluster(f"a100-80gb-x{gpus}")
    if inter_node_gbytes is None or cluster.num_nodes == 1:
        return cluster
    net = cluster.network
    return cluster.replace(network=net.replace(
        inter_node=net.inter_node.replace(gbytes_per_s=inter_node_gbytes),
        inter_rack=(net.inter_rack or net.inter_node).replace(gbytes_per_s=inter_node_gbytes),
    ))


def narayanan_cases() -> list[Case]:
    data = published()["narayanan2021"]
    out = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in data["rows"]:
        plan = Plan(tp=tp, pp=pp, dp=gpus // (tp * pp), micro_batch_size=1,
                    global_batch_size=batch, seq_len=2048, recompute="full", precision="fp16",
                    zero=0, comm=CommOptions(overlap=False), runtime=LEGACY_RUNTIME)
        out.append(Case(dataset="narayanan2021", label=f"{params}B t{tp} p{pp} {gpus} GPUs",
                        model=gpt(layers, hidden, heads), cluster=a100_cluster(gpus),
                        plan=plan, metric="tflops_per_gpu", convention="narayanan",
                        measured=float(tflops), split=DEVELOPMENT, source=data["source"]))
    return out


def _korthikanti_plan(tp: int, pp: int, gbs: int, mb: int, vp: int, mode: str) -> Plan:
    sp = mode == "sp_selective"
    return Plan(tp=tp, pp=pp, dp=1, vp=vp, micro_batch_size=mb, global_batch_size=gbs,
                seq_len=2048, recompute="selective" if sp else ("none" if mode == "none" else
                                                                 "full"),
                sequence_parallel=sp, precision="bf16", zero=0, comm=CommOptions(overlap=False),
                runtime=LEGACY_RUNTIME)


def korthikanti_cases() -> list[Case]:
    time_data = published()["korthikanti2022_time"]
    setups, out = {}, []
    for name, heads, hidden, layers, tp, pp, gpus, gbs, mb, vp, mode, seconds in time_data["rows"]:
        setups[name] = (heads, hidden, layers, tp, pp, gpus, gbs, mb, vp)
        out.append(Case(dataset="korthikanti2022", label=f"{name} {mode}",
                        model=gpt(layers, hidden, heads), cluster=a100_cluster(gpus),
                        plan=_korthikanti_plan(tp, pp, gbs, mb, vp, mode),
                        metric="step_time_s", measured=float(seconds), split=DEVELOPMENT,
                        source=time_data["source"]))
    mem_data = published()["korthikanti2022_memory"]
    for name, quantity, gib in mem_data["rows"]:
        heads, hidden, layers, tp, pp, gpus, gbs, mb, vp = setups[name]
        mode = {"weights_optimizer": "full", "activations_none": "none",
                "activations_sp_selective": "sp_selective"}[quantity]
        metric = "weights_optimizer_gib" if quantity == "weights_optimizer" else "activations_gib"
        out.append(Case(dataset="korthikanti2022_memory", label=f"{name} {quantity}",
                        model=gpt(layers, hidden, heads), cluster=a100_cluster(gpus),
                        plan=_korthikanti_plan(tp, pp, gbs, mb, vp, mode),
                        metric=metric, measured=float(gib), split=DEVELOPMENT,
                        source=mem_data["source"]))
    return out


@cache
def llama3_cluster(gpus: int) -> ClusterSpec:
    """H100 SXM servers of 8 in 3,072-GPU pods (384 servers: our racks), Llama 3's RoCE."""
    return load_cluster(f"h100-sxm-x{gpus}").replace(nodes_per_rack=384)


def llama3_cases() -> list[Case]:
    """Llama 3 405B on H100 (held out: nothing was fitted to these rows)."""
    data = published()["llama3_2024"]
    model = load_model("llama3-405b")
    out = []
    for gpus, tp, cp, pp, dp, seq, gbs, tflops in data["rows"]:
        # FSDP reduces each wrapped unit (a decoder layer) at once: one layer's 16-bit
        # gradients per collective, not DDP's 25 MB buckets.
        layer_mb = 2 * layer_rank_params(model, 1, tp, 1)[0] / 1e6
        plan = Plan(tp=tp, cp=cp, pp=pp, dp=dp, vp=8, micro_batch_size=1,
                    global_batch_size=gbs, seq_len=seq, recompute="none",
                    sequence_parallel=True, zero=2, precision="bf16",
                    pp_first_stage_layers=7, pp_last_stage_layers=7,
                    comm=CommOptions(overlap=True, bucket_mb=round(layer_mb), compression="bf16"),
                    runtime=RuntimeProfile(stack="pytorch", fused_kernels=True,
                                           grad_sync="micro_batch"))
        out.append(Case(dataset="llama3_2024", label=f"405B t{tp} c{cp} p{pp} d{dp} {gpus} GPUs",
                        model=model, cluster=llama3_cluster(gpus), plan=plan,
                        metric="tflops_per_gpu", convention="megatron_causal",
                        measured=float(tflops), split=DEVELOPMENT, source=data["source"]))
    return out


def vtrain_cases(folder: Path | None) -> list[Case]:
    """vTrain rows as cases ([] when the folder is absent)."""
    if folder is None:
        return []
    out = []
    for row in vtrain.read_rows(folder):
        multiple = 128 * row.tp
        vocab = -(-vtrain.VOCAB // multiple) * multiple
        inter = vtrain.INTER_NODE_GBYTES_PER_GPU if row.dataset == "vtrain_multi" else None
        plan = Plan(tp=row.tp, pp=row.pp, dp=row.dp, micro_batch_size=row.micro_batch,
                    global_batch_size=row.global_batch, seq_len=row.seq_len, recompute="full",
                    precision="fp16", zero=0, comm=CommOptions(overlap=False),
                    runtime=LEGACY_RUNTIME)
        split = CALIBRATION if row.index % 2 == 0 else DEVELOPMENT
        label = (f"#{row.index} h{row.hidden} l{row.layers} t{row.tp} p{row.pp} d{row.dp} "
                 f"mb{row.micro_batch} gbs{row.global_batch}")
        out.append(Case(dataset=row.dataset, label=label,
                        model=gpt(row.layers, row.hidden, row.heads, vocab, row.seq_len),
                        cluster=a100_cluster(row.gpus, inter), plan=plan,
                        metric="step_time_s", measured=row.iteration_s, split=split,
                        source="vTrain (Bang et al., MICRO'24), " + vtrain.FILES[row.dataset]))
    return out


def source_cases() -> list[Case]:
    """The held-out sources (``sources/*.yaml``) as cases."""
    from trainpilot.specs.loading import validate

    out = []
    for src in load_sources():
        for row in src.rows:
            where = f"{src.name}: {row['label']}"
            model = validate(ModelSpec, row["model"], doc="model", source=where)
            cluster = validate(ClusterSpec, row["cluster"], doc="cluster", source=where)
            plan = validate(Plan, row["plan"], doc="plan", source=where)
            out.append(Case(dataset=src.name, label=row["label"], model=model, cluster=cluster,
                            plan=plan, metric=row["metric"], convention=row["convention"],
                            measured=row["measured"], split=src.split, free=row["free"],
                            source=src.citation, batch=src.batch))
    return out


def all_cases(vtrain_dir: Path | None = None, *, find_vtrain: bool = True) -> list[Case]:
    """Every case: the development papers and the held-out sources always, the vTrain rows
    when their folder is found."""
    folder = vtrain_dir or (vtrain.locate() if find_vtrain else None)
    return narayanan_cases() + korthikanti_cases() + llama3_cases() + vtrain_cases(folder) + \
        source_cases()
