"""DeepSpeed exports, checked by DeepSpeed 0.19.8's own config classes: ``DeepSpeedConfig``
(batch arithmetic, precision, ZeRO's pydantic model, AutoTP's config) and AutoEP's
``validate_autoep_config`` over the world the plan uses."""

from __future__ import annotations

import json

import pytest

from tests.interop.matrix import cases
from trainpilot.plan.deepspeed import deepspeed_json
from trainpilot.specs import SpecError

pytest.importorskip("deepspeed")

REFUSED = {"plan.pp": {"pp4-even", "pp4-uneven", "pp4-vp2", "pp2-vp2", "pp16-vp8-405b",
                       "pp4-vp2-uneven-layout", "gpt3-learned-tp2-pp2", "moe-deepseek-v3-pp2"},
           "plan.cp": {"cp2-tp2"}, "plan.dp_shard": {"dense-zero3-hsdp-tp2"},
           "plan.recompute": {"dense-tp2-sp-zero1"}, "plan.tp": {"moe-qwen3-tp2-ep2"}}


class _DataParallel:
    """What DeepSpeedConfig asks an mpu: the data-parallel world size (no process group)."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def _ds_config(config: dict, dp: int, monkeypatch):
    from deepspeed.runtime import config as ds_config

    # DeepSpeedConfig asks the process group for this rank first; there is none here.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    return ds_config.DeepSpeedConfig(config, mpu=_DataParallel(dp))


@pytest.mark.parametrize("name,model,plan", cases(), ids=[c[0] for c in cases()])
def test_deepspeed_accepts_the_export(name, model, plan, monkeypatch):
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config

    refused = [field for field, names in REFUSED.items() if name in names]
    if refused:
        with pytest.raises(SpecError, match=refused[0]):
            deepspeed_json(plan, model)
        return
    config = json.loads(deepspeed_json(plan, model))
    ds = _ds_config(config, plan.dp, monkeypatch)
    assert ds.train_batch_size == plan.global_batch_size
    assert ds.gradient_accumulation_steps == plan.num_micro_batches
    assert ds.zero_optimization_stage == plan.zero
    assert ds.bfloat16_config.enabled == (plan.precision != "fp16")
    assert ds.tensor_parallel_config.autotp_size == (plan.tp if plan.tp > 1 else 0)
    if "expert_parallel" in config:
        ep = parse_autoep_config(config["expert_parallel"])
        validate_autoep_config(ep, world_size=plan.world_size, pp_size=1, tp_size=plan.tp,
                               sp_size=1, zero_stage=plan.zero)
        assert ep.autoep_size == plan.ep


def test_deepspeed_rejects_a_wrong_batch(monkeypatch):
    """Negative control: DeepSpeed's own batch check fails when the arithmetic is off."""
    _, model, plan = cases()[1]
    config = json.loads(deepspeed_json(plan, model))
    config["gradient_accumulation_steps"] += 1
    with pytest.raises(AssertionError, match="train_batch_size"):
        _ds_config(config, plan.dp, monkeypatch)
