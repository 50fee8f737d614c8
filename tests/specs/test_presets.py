"""Every preset loads, dumps and loads back to an equal document; published counts hold."""

from __future__ import annotations

import pytest

from trainpilot.perf.flops import count_params, model_flops_per_token
from trainpilot.specs import (
    ClusterSpec,
    ModelSpec,
    Plan,
    TrainJob,
    dump,
    load_cluster,
    load_job,
    load_model,
    load_plan,
    presets,
)

CLUSTERS = list(presets.NAMED_CLUSTERS) + presets.EXAMPLE_CLUSTERS


@pytest.mark.parametrize("name", list(presets.MODELS))
def test_model_preset_round_trips(name, tmp_path):
    model = load_model(name)
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"{name}{suffix}"
        dump(model, path)
        again = load_model(str(path))
        assert again == model
        assert dump(again) == dump(model)


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_preset_round_trips(name, tmp_path):
    cluster = load_cluster(name)
    path = tmp_path / "cluster.yaml"
    dump(cluster, path)
    assert load_cluster(str(path)) == cluster


@pytest.mark.parametrize("name", list(presets.JOBS))
def test_job_preset_round_trips(name, tmp_path):
    job = load_job(name)
    path = tmp_path / "job.yaml"
    dump(job, path)
    again = load_job(str(path))
    assert again == job
    # The plan alone round-trips too, as a file and inline.
    plan_path = tmp_path / "plan.yaml"
    dump(job.plan, plan_path)
    assert load_plan(str(plan_path)) == job.plan


@pytest.mark.parametrize("name", list(presets.DEVICES))
def test_device_presets_build_clusters(name):
    cluster = load_cluster(f"{name}-x16")
    assert cluster.num_devices == 16 and cluster.device.name == name


def test_inline_plan_matches_file():
    plan = load_plan("tp=8,pp=16,dp=8,micro_batch_size=1,global_batch_size=1536,seq_len=2048,"
                     "recompute=full,comm.bucket_mb=50")
    assert (plan.tp, plan.pp, plan.dp, plan.recompute, plan.comm.bucket_mb) == (8, 16, 8, "full", 50)
    assert plan.world_size == 1024 and plan.num_micro_batches == 192
    assert plan.pp_schedule == "1f1b"


# Published parameter counts: the model cards' totals (and active counts for MoE).
@pytest.mark.parametrize("name,total_b,active_b", [
    ("llama3-8b", 8.03, 8.03),
    ("llama3-70b", 70.55, 70.55),
    ("llama3-405b", 405.85, 405.85),
    ("gpt3-175b", 175.2, 175.2),
    ("mixtral-8x7b", 46.70, 12.88),
    ("deepseek-v3", 671.0, 37.5),
    ("qwen3-30b-a3b", 30.5, 3.3),
])
def test_parameter_counts_match_published(name, total_b, active_b):
    counts = count_params(load_model(name))
    assert counts.total / 1e9 == pytest.approx(total_b, rel=0.005)
    assert counts.active / 1e9 == pytest.approx(active_b, rel=0.02)


def test_gpt3_flops_equal_narayanan_formula():
    """Model FLOPs per token = 72*l*h^2*(1 + s/(6h) + V/(12*l*h)) for the GPT family."""
    model = load_model("gpt3-175b")
    layers, hidden, vocab, seq = 96, 12288, 51200, 2048
    expected = 72 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    assert model_flops_per_token(model, seq) == pytest.approx(expected, rel=1e-12)


def test_document_types():
    job = load_job("gpt3-175b-a100-1024")
    assert isinstance(job, TrainJob)
    assert isinstance(job.model, ModelSpec) and isinstance(job.cluster, ClusterSpec)
    assert isinstance(job.plan, Plan)
    assert job.cluster.num_devices == 1024 and job.cluster.devices_per_node == 8
