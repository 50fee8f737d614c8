"""torchtitan exports, loaded by torchtitan 0.3.0 itself: its ConfigManager imports the
exported module and parses it with tyro (types checked), ParallelDims validates the layout,
the model is built from the config on the meta device, and the pipeline split is checked with
torchtitan's own schedule and stage-mapping functions."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.interop.matrix import cases
from trainpilot.perf.flops import count_params
from trainpilot.plan.torchtitan import FLAVORS, torchtitan_config
from trainpilot.specs import SpecError, load_model

pytest.importorskip("torchtitan")

# Rows torchtitan 0.3.0 cannot run as planned (the exporter says why in one line).
REFUSED = {"dense-tp2-sp-zero1": "selective", "gpt3-learned-tp2-pp2": "registry",
           "moe-mixtral-ep4": "registry", "tied-dense-zero1": "registry",
           "moe-deepseek-v3-pp2": "MTP"}


def _load(tmp_path, name: str, source: str):
    from torchtitan.config import ConfigManager

    module = f"tp_job_{name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        return ConfigManager().parse_args(["--module", module, "--config", "trainpilot_job"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)


def _meta_model(config):
    with torch.device("meta"):
        return config.model_spec.model.build()


@pytest.mark.parametrize("name,model,plan", cases(), ids=[c[0] for c in cases()])
def test_torchtitan_loads_and_validates_the_export(tmp_path, name, model, plan):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

    if name in REFUSED:
        with pytest.raises(SpecError, match=REFUSED[name]):
            torchtitan_config(plan, model)
        return
    config = _load(tmp_path, name, torchtitan_config(plan, model))
    par, train = config.parallelism, config.training
    dims = ParallelDims.from_config(par, plan.world_size)
    assert dims.dp_replicate * dims.dp_shard == plan.dp and dims.tp == plan.tp
    # The batch the plan priced: micro-batches of micro_batch_size, num_micro_batches of them.
    dp = dims.dp_replicate * dims.dp_shard
    if plan.pp == 1:
        assert train.local_batch_size == plan.micro_batch_size
        assert train.global_batch_size // (train.local_batch_size * dp) == plan.num_micro_batches
    else:
        assert train.local_batch_size // par.pipeline_parallel_microbatch_size == (
            plan.num_micro_batches)
        assert train.global_batch_size == train.local_batch_size * dp
    if model.moe is not None:  # torchtitan's mesh rule: dp_shard * cp * tp == efsdp * ep
        assert (dims.dp_shard * dims.cp * dims.tp) % par.expert_parallel_degree == 0
    built = _meta_model(config)
    names = [n for n, _ in built.named_children()]
    params = sum(p.numel() for n, p in built.named_parameters() if not n.startswith("mtp"))
    assert params == count_params(model).total
    if plan.pp > 1:
        parts = par.module_fqns_per_model_part
        children = [f"layers.{k}" for k in built.layers.keys()] + [
            n for n in names if n != "layers"]
        flat = [m for part in parts for m in part]
        assert sorted(flat) == sorted(children), "every module in exactly one part"
        schedule = get_schedule_class(par.pipeline_parallel_schedule)
        single = issubclass(schedule, PipelineScheduleSingle)
        assert len(parts) == plan.pp * (1 if single else plan.vp)
        for rank in range(plan.pp):
            stages = _get_pp_rank_to_stage_indices_mapping(rank, plan.pp,
                                                           par.pipeline_parallel_schedule,
                                                           len(parts))
            layers = sum(len([m for m in parts[s] if m.startswith("layers.")]) for s in stages)
            assert layers == sum(plan_chunks(model, plan)[rank])
    assert config.activation_checkpoint is None if plan.recompute == "none" else (
        type(config.activation_checkpoint).__qualname__ == "FullAC.Config")


def plan_chunks(model, plan):
    from trainpilot.specs.job import virtual_stage_layers

    return virtual_stage_layers(model, plan)


@pytest.mark.parametrize("preset", list(FLAVORS))
def test_registry_flavors_are_our_presets(preset):
    """The flavor table is right: torchtitan's model has the preset's parameter count."""
    import importlib

    module, flavor, _ = FLAVORS[preset]
    spec = importlib.import_module(f"torchtitan.models.{module}").model_registry(flavor)
    with torch.device("meta"):
        built = spec.model.build()
    assert sum(p.numel() for p in built.parameters()) == count_params(load_model(preset)).total


def test_the_validation_can_fail(tmp_path):
    """Negative control: torchtitan's own ParallelDims rejects a world the layout misses."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    name, model, plan = cases()[5]
    config = _load(tmp_path, name, torchtitan_config(plan, model))
    with pytest.raises(AssertionError, match="Invalid parallel dims"):
        ParallelDims.from_config(config.parallelism, plan.world_size * 2)


def test_custom_models_are_refused_in_one_line():
    model = load_model("llama3-8b").replace(rope_theta=10000.0)
    _, _, plan = cases()[1]
    with pytest.raises(SpecError) as info:
        torchtitan_config(plan, model)
    assert "\n" not in str(info.value) and "registry" in str(info.value)


def test_per_op_recompute_is_torchtitans_selective_ac(tmp_path):
    """``recompute: op`` is priced as torchtitan's per-op SelectiveAC; torchtitan's own
    ConfigManager loads the export as exactly that policy."""
    from trainpilot.specs import Plan

    plan = Plan(dp=8, zero=3, micro_batch_size=1, global_batch_size=8, seq_len=8192,
                recompute="op")
    config = _load(tmp_path, "op", torchtitan_config(plan, load_model("llama3-8b")))
    assert type(config.activation_checkpoint).__qualname__ == "SelectiveAC.Config"
