"""Megatron exports, checked by Megatron itself.

In CI: every flag is one Megatron-LM's parser defines (tests/data, listed by that parser at
core_v0.16.1), and the flags build megatron-core 0.16.1's own ``TransformerConfig`` /
``MLATransformerConfig`` (whose ``__post_init__`` is Megatron's model validation),
``DistributedDataParallelConfig`` and the ``RankGenerator`` process-group layouts of
``parallel_state``. Megatron-LM's ``parse_args`` + ``validate_args`` themselves are not in any
wheel: ``test_megatron_lm_parser_accepts_the_matrix`` runs them where ``MEGATRON_LM_ROOT``
points at a checkout of tag core_v0.16.1 (docs/interop.md says how).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interop.matrix import cases, megatron_runtime_cases, refusals
from trainpilot.plan.megatron import megatron_export
from trainpilot.specs import SpecError
from trainpilot.specs.loading import validate

pytest.importorskip("megatron.core")

FLAGS = {line.strip() for line in (Path(__file__).parents[1] / "data"
                                   / "megatron_lm_core_v0.16.1_flags.txt").read_text().splitlines()
         if line.startswith("--")}

# flag -> TransformerConfig field (None: the flag's own name with dashes as underscores).
_CONFIG = {
    "--tensor-model-parallel-size": None, "--pipeline-model-parallel-size": None,
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
    "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
    "--account-for-embedding-in-pipeline-split": None,
    "--account-for-loss-in-pipeline-split": None, "--pipeline-model-parallel-layout": None,
    "--expert-model-parallel-size": None, "--expert-tensor-parallel-size": None,
    "--context-parallel-size": None, "--sequence-parallel": None,
    "--recompute-granularity": None, "--recompute-method": None, "--recompute-num-layers": None,
    "--bf16": None, "--fp16": None, "--fp8-format": "fp8",
    "--num-layers": None, "--hidden-size": None, "--num-attention-heads": None,
    "--ffn-hidden-size": None, "--num-query-groups": None, "--kv-channels": None,
    "--swiglu": "gated_linear_unit", "--normalization": None,
    "--norm-epsilon": "layernorm_epsilon", "--qk-layernorm": None,
    "--disable-bias-linear": "add_bias_linear", "--num-experts": "num_moe_experts",
    "--moe-router-topk": None, "--moe-ffn-hidden-size": None, "--moe-grouped-gemm": None,
    "--moe-token-dispatcher-type": None, "--moe-shared-expert-intermediate-size": None,
    "--moe-layer-freq": None, "--moe-router-score-function": None,
    "--moe-router-pre-softmax": None, "--moe-router-enable-expert-bias": None,
    "--moe-router-num-groups": None, "--moe-router-group-topk": None,
    "--moe-router-topk-scaling-factor": None, "--moe-router-load-balancing-type": None,
    "--moe-aux-loss-coeff": None, "--mtp-num-layers": None,
    "--multi-latent-attention": "multi_latent_attention", "--q-lora-rank": None,
    "--kv-lora-rank": None, "--qk-head-dim": None, "--qk-pos-emb-head-dim": None,
    "--v-head-dim": None, "--rope-type": None, "--rotary-scaling-factor": None,
    "--mscale": None, "--mscale-all-dim": None,
    "--no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
    "--moe-expert-capacity-factor": None, "--moe-pad-expert-input-to-capacity": None,
    "--cuda-graph-impl": None, "--cuda-graph-scope": None, "--fp8-recipe": None,
}
# Flags that configure the model constructor, the data-parallel wrapper or the trainer, not
# TransformerConfig: checked by name (FLAGS) and, for the DDP ones, by its config below.
_ELSEWHERE = {"--micro-batch-size", "--group-query-attention", "--global-batch-size", "--seq-length",
              "--max-position-embeddings", "--padded-vocab-size", "--position-embedding-type",
              "--rotary-base", "--use-rope-scaling", "--rope-scaling-factor",
              "--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
              "--overlap-grad-reduce", "--overlap-param-gather", "--use-torch-fsdp2",
              "--ckpt-format"}
_FALSE_FLAGS = {"--disable-bias-linear", "--no-gradient-accumulation-fusion"}
_FLOATS = {"layernorm_epsilon", "moe_router_topk_scaling_factor", "moe_aux_loss_coeff",
           "rotary_scaling_factor", "mscale", "mscale_all_dim", "moe_expert_capacity_factor"}


def transformer_config(flags: list[tuple[str, object]]):
    """megatron-core's own config object for the exported flags (its ``__post_init__``
    raises for what Megatron's model code refuses)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    kwargs: dict = {}
    for flag, value in flags:
        if flag in _ELSEWHERE:
            continue
        assert flag in _CONFIG, f"{flag}: add it to the mapping or to _ELSEWHERE"
        name = _CONFIG[flag] or flag[2:].replace("-", "_")
        if value is None:
            kwargs[name] = flag not in _FALSE_FLAGS
        elif name == "moe_layer_freq":
            kwargs[name] = ast.literal_eval(str(value))
        elif name in _FLOATS:
            kwargs[name] = float(value)
        elif isinstance(value, list):
            kwargs[name] = list(value)
        else:
            kwargs[name] = int(value) if str(value).lstrip("-").isdigit() else value
    if kwargs.pop("gated_linear_unit", False):
        kwargs.update(gated_linear_unit=True, activation_func=F.silu)
    if kwargs.get("bf16") or "fp8" in kwargs:
        kwargs["params_dtype"] = torch.bfloat16
    if kwargs.get("fp16"):
        kwargs["params_dtype"] = torch.float16
    # core_transformer_config_from_args: the pipeline sends activations in the params dtype.
    kwargs["pipeline_dtype"] = kwargs.get("params_dtype", torch.float32)
    cls = MLATransformerConfig if kwargs.pop("multi_latent_attention", False) else (
        TransformerConfig)
    if cls is TransformerConfig:
        kwargs.pop("rope_type", None)  # MLA only (argument.py pops it for standard attention)
    return cls(**kwargs)


def _check_layout(flags: dict, world_size: int) -> None:
    """megatron-core's process-group layout (parallel_state.RankGenerator) for the world."""
    from megatron.core.parallel_state import RankGenerator

    tp = int(flags["--tensor-model-parallel-size"])
    pp = int(flags["--pipeline-model-parallel-size"])
    cp = int(flags.get("--context-parallel-size", 1))
    ep = int(flags.get("--expert-model-parallel-size", 1))
    etp = int(flags.get("--expert-tensor-parallel-size", tp))
    dp, rest = divmod(world_size, tp * pp * cp)
    assert rest == 0
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    assert dense.world_size == world_size and len(dense.get_ranks("dp")) == world_size // dp
    expert_dp, rest = divmod(world_size, etp * ep * pp)
    assert rest == 0, f"expert layout: {world_size} ranks over etp*ep*pp = {etp * ep * pp}"
    experts = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order="tp-ep-dp-pp")
    assert experts.world_size == world_size


_ALL = cases() + megatron_runtime_cases()


@pytest.mark.parametrize("name,model,plan", _ALL, ids=[c[0] for c in _ALL])
def test_megatron_core_accepts_the_export(name, model, plan):
    from megatron.core.distributed import DistributedDataParallelConfig

    export = megatron_export(plan, model)
    flags = [f for f, _ in export.flags]
    assert not set(flags) - FLAGS, f"flags Megatron-LM does not define: {set(flags) - FLAGS}"
    assert len(flags) == len(set(flags))
    config = transformer_config(export.flags)
    by_flag = dict(export.flags)
    _check_layout(by_flag, plan.world_size)
    DistributedDataParallelConfig(
        use_distributed_optimizer="--use-distributed-optimizer" in by_flag,
        overlap_grad_reduce="--overlap-grad-reduce" in by_flag,
        overlap_param_gather="--overlap-param-gather" in by_flag)
    # The model's real hyper-parameters came through.
    assert config.num_layers == model.num_hidden_layers
    assert config.layernorm_epsilon == model.norm_eps
    assert config.qk_layernorm == model.qk_norm
    if model.position_embedding == "rope":
        assert int(by_flag["--rotary-base"]) == model.rope_theta
    if model.moe is not None:
        assert config.num_moe_experts == model.moe.num_experts
        assert config.moe_router_score_function == model.moe.router_score
        assert config.moe_router_enable_expert_bias == model.moe.router_expert_bias
    assert (config.mtp_num_layers or 0) == model.num_mtp_layers
    rt = plan.runtime
    if rt.moe_capacity_factor is not None:
        assert config.moe_expert_capacity_factor == rt.moe_capacity_factor
        assert config.moe_pad_expert_input_to_capacity
    if rt.cuda_graph_scope:
        assert config.cuda_graph_impl != "none"
        assert {s.name for s in config.cuda_graph_scope} == set(rt.cuda_graph_scope)
    if plan.precision == "fp8":
        assert config.fp8_recipe == {"current": "tensorwise"}.get(plan.fp8_recipe,
                                                                   plan.fp8_recipe)
    assert ("--untie-embeddings-and-output-weights" in by_flag) != model.tie_word_embeddings


def test_the_real_hyper_parameters_reach_megatron():
    from tests.interop.matrix import cases as all_cases

    got = {n: dict(megatron_export(p, m).flags) for n, m, p in all_cases()}
    ds, llama405 = got["moe-deepseek-v3-pp2"], got["pp16-vp8-405b"]
    assert llama405["--rotary-base"] == 500000 and "--use-rope-scaling" in llama405
    assert llama405["--rope-scaling-factor"] == "8"
    assert "--qk-layernorm" in got["moe-qwen3-tp2-ep2"]
    assert ds["--moe-router-score-function"] == "sigmoid" and ds["--mtp-num-layers"] == 1
    assert (ds["--moe-router-num-groups"], ds["--moe-router-group-topk"]) == (8, 4)
    assert ds["--rope-type"] == "yarn" and ds["--rotary-scaling-factor"] == "40"


def test_a_config_megatron_rejects_fails_here_too():
    """Negative control: megatron-core's validation is live (not a check that cannot fail)."""
    _, model, plan = cases()[0]
    flags = megatron_export(plan, model).flags
    bad = [(f, 3 if f == "--num-query-groups" else v) for f, v in flags]  # 32 heads % 3
    with pytest.raises((AssertionError, ValueError)):
        transformer_config(bad)


def test_megatron_and_the_plan_refuse_a_dropless_moe_graph():
    """Negative control for the graph scopes: Megatron-Core refuses to capture a dropless MoE
    block (dynamic shapes) and so does the Plan, in one line."""
    _, model, plan = megatron_runtime_cases()[0]
    flags = [(f, ["attn", "moe"] if f == "--cuda-graph-scope" else v)
             for f, v in megatron_export(plan, model).flags]
    with pytest.raises(AssertionError, match="drop-padding"):
        transformer_config(flags)
    data = {**plan.model_dump(), "runtime": {"stack": "megatron",
                                             "cuda_graph_scope": ["attn", "moe"]}}
    with pytest.raises(SpecError, match="moe_capacity_factor") as info:
        validate(type(plan), data, doc="plan")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,model,plan", refusals(), ids=[c[0] for c in refusals()])
def test_refused_in_one_line(name, model, plan):
    with pytest.raises(SpecError) as info:
        megatron_export(plan, model)
    assert "\n" not in str(info.value) and "use-torch-fsdp2" in str(info.value)


@pytest.mark.skipif("MEGATRON_LM_ROOT" not in os.environ,
                    reason="Megatron-LM's parser is not in a wheel: set MEGATRON_LM_ROOT to a "
                           "checkout of tag core_v0.16.1")
@pytest.mark.timeout(240)
def test_megatron_lm_parser_accepts_the_matrix():
    rows = []
    for name, model, plan in cases():
        export = megatron_export(plan, model)
        rows.append({"id": name, "argv": export.argv(), "env": export.env,
                     "world_size": plan.world_size})
    # Negative control: FSDP2 with pipelining, which our exporter refuses, Megatron refuses.
    _, model, plan = refusals()[0]
    argv = megatron_export(plan.replace(zero=1), model).argv()
    argv = [a for a in argv if a not in ("--use-distributed-optimizer", "--overlap-param-gather")]
    rows.append({"id": "negative-fsdp2-pp", "env": {}, "world_size": plan.world_size,
                 "argv": argv + ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]})
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_lm_runner.py"))],
                         input=json.dumps(rows), capture_output=True, text=True, check=True)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert "pipeline parallelism" in results.pop("negative-fsdp2-pp")
    assert results == {name: "ok" for name, _, _ in cases()}
