"""A chosen plan for other tools, each checked in tests/interop by the tool that consumes it:

* ``yaml``: our plan document (loads back as is);
* ``megatron``: Megatron-LM ``pretrain_gpt.py`` arguments (plan/megatron.py);
* ``torchtitan``: a torchtitan 0.3.0 config module (plan/torchtitan.py);
* ``deepspeed``: a DeepSpeed ds_config.json (plan/deepspeed.py);
* ``slurm``: an sbatch script running ``trainpilot train`` on every node (plan/slurm.py).

A combination the consumer refuses raises SpecError with one line; a mapping that is not
one-to-one is stated in the output itself (a comment, a docstring note, a ``trainpilot``
block), never silently dropped.
"""

from __future__ import annotations

from trainpilot.perf.predict import Prediction
from trainpilot.plan.deepspeed import deepspeed_json
from trainpilot.plan.megatron import megatron_args
from trainpilot.plan.slurm import slurm_script
from trainpilot.plan.torchtitan import torchtitan_config
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError, dump

FORMATS = ("yaml", "megatron", "torchtitan", "deepspeed", "slurm")

__all__ = ["FORMATS", "deepspeed_json", "export", "megatron_args", "plan_yaml",
           "slurm_script", "torchtitan_config"]


def export(fmt: str, plan: Plan, model: ModelSpec, cluster: ClusterSpec,
           prediction: Prediction | None = None) -> str:
    """The plan in ``fmt`` (one of FORMATS) as text."""
    if fmt == "yaml":
        return plan_yaml(plan, model, cluster, prediction)
    if fmt == "megatron":
        return megatron_args(plan, model)
    if fmt == "torchtitan":
        return torchtitan_config(plan, model)
    if fmt == "deepspeed":
        return deepspeed_json(plan, model)
    if fmt == "slurm":
        return slurm_script(plan, model, cluster)
    raise SpecError("--export", fmt, f"valid: {', '.join(FORMATS)}")


def plan_yaml(plan: Plan, model: ModelSpec, cluster: ClusterSpec,
              prediction: Prediction | None = None) -> str:
    """Our plan document, headed by what it was planned for (comments, so it loads as is)."""
    head = [f"# plan for {model.name} on {cluster.name} ({cluster.num_devices} x "
            f"{cluster.device.name})"]
    if prediction is not None:
        head.append(f"# predicted: {prediction.step_time_s:.3f} s/step, "
                    f"{prediction.tokens_per_s:,.0f} tokens/s, MFU {prediction.mfu:.1%}, "
                    f"peak {prediction.memory_gib['peak']:.1f} GiB per device")
    return "\n".join(head) + "\n" + dump(plan)
