"""Exports: Megatron-LM arguments, torchtitan TOML, SLURM script, our plan YAML."""

from __future__ import annotations

import tomllib

from trainpilot.plan.export import export, megatron_args, slurm_script, torchtitan_toml
from trainpilot.specs import Plan, load_job, load_plan


def _job(name):
    j = load_job(name)
    return j.model, j.cluster, j.plan


def test_megatron_arguments():
    model, _, plan = _job("llama3-405b-h100-16384")
    plan = plan.replace(vp=1, pp_schedule="1f1b", recompute="selective", zero=1)
    args = megatron_args(plan, model)
    for expected in ("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 16",
                     "--decoder-first-pipeline-num-layers 7",
                     "--decoder-last-pipeline-num-layers 7", "--sequence-parallel",
                     "--recompute-granularity selective", "--use-distributed-optimizer",
                     "--micro-batch-size 1", "--global-batch-size 2048", "--seq-length 8192",
                     "--num-query-groups 8", "--swiglu", "--num-layers 126"):
        assert expected in args, expected
    # Llama 3's interleaved split: the embedding and the loss each stand in for one layer.
    args = megatron_args(_job("llama3-405b-h100-16384")[2], model)
    for expected in ("--num-virtual-stages-per-pipeline-rank 8",
                     "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split"):
        assert expected in args, expected
    assert "--decoder-first-pipeline-num-layers" not in args
    # Edge stages that divide into their virtual stages: Megatron's first/last flags.
    even_edges = megatron_args(plan.replace(vp=2, pp_schedule="interleaved",
                                            pp_first_stage_layers=6, pp_last_stage_layers=8),
                               model)
    assert "--num-virtual-stages-per-pipeline-rank 2" in even_edges
    assert "--decoder-first-pipeline-num-layers 6" in even_edges
    interleaved = megatron_args(Plan(tp=8, pp=8, vp=3, dp=16, global_batch_size=1536,
                                     seq_len=2048, zero=3), _job("gpt3-175b-a100-1024")[0])
    assert "--num-layers-per-virtual-pipeline-stage 4" in interleaved
    assert "--use-torch-fsdp2" in interleaved


def test_megatron_moe_arguments():
    model, _, plan = _job("deepseek-v3-h800-2048")
    args = megatron_args(plan, model)
    assert "--expert-model-parallel-size 64" in args and "--num-experts 256" in args
    assert "--multi-latent-attention" in args and "--moe-layer-freq" in args


def test_torchtitan_toml_parses_and_multiplies_to_the_world():
    model, cluster, plan = _job("gpt3-175b-a100-1024")
    for p in (plan, plan.replace(zero=3, dp_shard=4), plan.replace(zero=0)):
        data = tomllib.loads(torchtitan_toml(p, model))
        par = data["parallelism"]
        world = (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
                 * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"]
                 * par["context_parallel_degree"])
        assert world == cluster.num_devices
        assert data["activation_checkpoint"]["mode"] == p.recompute
    model, _, plan = _job("llama3-405b-h100-16384")
    uneven = tomllib.loads(torchtitan_toml(plan.replace(vp=1, pp_schedule="1f1b"), model))
    assert uneven["parallelism"]["pipeline_parallel_split_points"][:2] == ["layers.7",
                                                                          "layers.15"]
    interleaved = tomllib.loads(torchtitan_toml(plan, model))["parallelism"]
    parts = interleaved["module_fqns_per_model_part"]
    assert len(parts) == 16 * 8 and parts[0] == ["tok_embeddings"]
    assert parts[1] == ["layers.0"] and parts[-1] == ["norm", "output"]
    assert sum(len(p) for p in parts) == 126 + 3


def test_slurm_script_starts_torchrun_on_every_node():
    model, cluster, plan = _job("gpt3-175b-a100-1024")
    text = slurm_script(plan, model, cluster)
    assert "#SBATCH --nodes=128" in text and "--nnodes=128" in text
    assert "--nproc-per-node=8" in text and "--rdzv-backend=c10d" in text
    assert "trainpilot train" in text


def test_plan_yaml_round_trips(tmp_path):
    model, cluster, plan = _job("deepseek-v3-h800-2048")
    path = tmp_path / "plan.yaml"
    path.write_text(export("yaml", plan, model, cluster))
    assert load_plan(path) == plan
