"""Exports: what each format says for the presets' jobs, and the plan CLI's --export/--pick.
The consumers' own validators run on the export matrix in tests/interop."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import run_cli
from trainpilot.plan.export import FORMATS, export, megatron_args, slurm_script, torchtitan_config
from trainpilot.specs import Plan, load_job, load_plan

ROOT = Path(__file__).parents[2]


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
                     "--num-query-groups 8", "--swiglu", "--num-layers 126",
                     "--rotary-base 500000", "--use-rope-scaling", "--rope-scaling-factor 8",
                     "--norm-epsilon 1e-05", "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert expected in args, expected
    # Llama 3's interleaved split: the embedding and the loss each stand in for one layer.
    args = megatron_args(_job("llama3-405b-h100-16384")[2], model)
    for expected in ("--num-virtual-stages-per-pipeline-rank 8",
                     "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split"):
        assert expected in args, expected
    assert "--decoder-first-pipeline-num-layers" not in args
    even_edges = megatron_args(plan.replace(vp=2, pp_schedule="interleaved",
                                            pp_first_stage_layers=6, pp_last_stage_layers=8),
                               model)
    assert "--num-virtual-stages-per-pipeline-rank 2" in even_edges
    assert "--decoder-first-pipeline-num-layers 6" in even_edges
    fsdp = megatron_args(Plan(tp=8, pp=1, dp=128, global_batch_size=1536, seq_len=2048,
                              zero=3), _job("gpt3-175b-a100-1024")[0])
    assert "--use-torch-fsdp2" in fsdp and "--no-gradient-accumulation-fusion" in fsdp
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in fsdp  # FSDP2 needs more than one queue


def test_megatron_moe_arguments():
    model, _, plan = _job("deepseek-v3-h800-2048")
    args = megatron_args(plan, model)
    for expected in ("--expert-model-parallel-size 64", "--num-experts 256",
                     "--multi-latent-attention", "--moe-layer-freq",
                     "--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias",
                     "--moe-router-num-groups 8", "--moe-router-group-topk 4",
                     "--moe-router-topk-scaling-factor 2.5", "--mtp-num-layers 1",
                     "--rope-type yarn", "--rotary-scaling-factor 40", "--norm-epsilon 1e-06"):
        assert expected in args, expected


def test_torchtitan_module_sets_the_plan():
    model, _, plan = _job("llama3-405b-h100-16384")
    text = torchtitan_config(plan.replace(recompute="full"), model)
    compile(text, "job.py", "exec")
    assert 'model_registry("405B")' in text and "FullAC.Config()" in text
    assert "config.parallelism.tensor_parallel_degree = 8" in text
    parts = re.search(r"module_fqns_per_model_part = (.*)", text).group(1)
    parts = eval(parts)  # noqa: S307 (our own output: a list literal)
    assert len(parts) == 16 * 8 and parts[0] == ["tok_embeddings"]
    assert parts[1] == ["layers.0"] and parts[-1] == ["norm", "lm_head"]
    assert sum(len(p) for p in parts) == 126 + 3


def test_slurm_script_carries_its_documents():
    model, cluster, plan = _job("gpt3-175b-a100-1024")
    text = slurm_script(plan, model, cluster)
    assert "#SBATCH --nodes=128" in text and "--nnodes=128" in text
    assert "--nproc-per-node=8" in text and "--rdzv-backend=c10d" in text
    assert '--cluster "$job_dir/job/cluster.yaml"' in text and "| head" not in text
    assert f"name: {cluster.name}" in text and f"num_hidden_layers: {model.num_layers}" in text


def test_plan_yaml_round_trips(tmp_path):
    model, cluster, plan = _job("deepseek-v3-h800-2048")
    path = tmp_path / "plan.yaml"
    path.write_text(export("yaml", plan, model, cluster))
    assert load_plan(path) == plan


def test_readme_export_list_matches_the_cli():
    help_text = run_cli("plan", "--help").stdout
    choices = re.search(r"--export \{([a-z,]+)\}", help_text).group(1).split(",")
    assert tuple(choices) == FORMATS
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"`--export ([a-z|]+)`", readme).group(1).split("|")
    assert sorted(listed) == sorted(FORMATS)


def test_export_any_ranked_plan_and_deepspeed(tmp_path):
    base = ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-x16",
            "--global-batch-size", "64", "--seq-len", "4096"]
    ranking = json.loads(run_cli(*base, "--top", "3", "--json").stdout)["plans"]
    out = tmp_path / "third.yaml"
    result = run_cli(*base, "--export", "yaml", "--pick", "3", "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert load_plan(out).to_dict() == Plan(**ranking[2]["plan"]).to_dict()
    # DeepSpeed: the first ranked plan DeepSpeed can run (its config refuses pp / cp / ...).
    ranking = json.loads(run_cli(*base, "--top", "8", "--json").stdout)["plans"]
    for pick, row in enumerate(ranking, start=1):
        p = row["plan"]
        if p["pp"] == 1 and p["cp"] == 1 and p.get("recompute") != "selective":
            result = run_cli(*base, "--top", "8", "--export", "deepspeed", "--pick", str(pick))
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["train_batch_size"] == 64
            break
    else:
        raise AssertionError("no plan DeepSpeed can run in the top 8")
    result = run_cli(*base, "--top", "2", "--export", "yaml", "--pick", "1000000")
    assert result.returncode == 2 and "--pick" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
