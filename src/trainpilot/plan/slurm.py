"""A plan as a SLURM batch script that starts ``trainpilot train`` under torchrun on every node.

The script carries the three job documents it was made from (model, cluster, plan) as
YAML heredocs and writes them into ``<run dir>/job/`` before ``srun``, so a custom cluster
file or a Hugging Face model runs the same on every node as it was planned, with nothing
else to copy. One task per node; torchrun's c10d rendezvous on the first node of the
allocation (``scontrol show hostnames``). Arguments given to ``sbatch script ...`` after the
script name pass on to ``trainpilot train`` (``--steps 1000``).
"""

from __future__ import annotations

import shlex

from trainpilot.specs import ClusterSpec, ModelSpec, Plan, dump

_EOF = "TRAINPILOT_EOF"


def slurm_script(plan: Plan, model: ModelSpec, cluster: ClusterSpec, *,
                 job_name: str | None = None) -> str:
    """The sbatch script (bash). ``--nnodes`` = nodes, ``--nproc-per-node`` = devices per
    node; when the plan uses fewer devices than a node has, one node with that many."""
    per_node = cluster.devices_per_node
    nodes, rest = divmod(plan.world_size, per_node)
    if rest or nodes == 0:
        nodes, per_node = 1, plan.world_size
    name = job_name or f"{model.name}-{nodes}x{per_node}"
    gpu = cluster.device.name != "cpu" and cluster.network.collective_library != "gloo"
    docs = []
    for kind, spec in (("model", model), ("cluster", cluster), ("plan", plan)):
        text = dump(spec)
        if _EOF in text:  # a name containing the delimiter would end the heredoc early
            raise ValueError(f"{kind} document contains {_EOF}")
        docs.append(f"cat > \"$job_dir/job/{kind}.yaml\" <<'{_EOF}'\n{text.rstrip()}\n{_EOF}")
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={shlex.quote(name)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpu else []),
        "#SBATCH --exclusive",
        "#SBATCH --output=%x-%j.out",
        f"# Layout: tp={plan.tp} pp={plan.pp} vp={plan.vp} dp={plan.dp} cp={plan.cp} "
        f"ep={plan.ep} zero={plan.zero} on {cluster.name} ({nodes} x {per_node}).",
        "set -euo pipefail",
        "# sed reads every line (head would exit early and SIGPIPE scontrol under pipefail).",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        'job_dir="${SLURM_SUBMIT_DIR:-$PWD}/runs/$SLURM_JOB_ID"',
        '# The documents this script was made from, for every node (a shared filesystem).',
        'mkdir -p "$job_dir/job"',
    ]
    launch = [
        "export OMP_NUM_THREADS=1",
        "srun trainpilot train \\",
        f"  --nnodes={nodes} \\",
        f"  --nproc-per-node={per_node} \\",
        "  --rdzv-backend=c10d \\",
        '  --rdzv-endpoint="$head_node:${TRAINPILOT_RDZV_PORT:-29500}" \\',
        '  --rdzv-id="$SLURM_JOB_ID" \\',
        '  --model "$job_dir/job/model.yaml" --cluster "$job_dir/job/cluster.yaml" \\',
        '  --plan "$job_dir/job/plan.yaml" --run-dir "$job_dir" "$@"',
    ]
    return "\n".join(header + docs + launch) + "\n"
