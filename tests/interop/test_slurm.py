"""SLURM exports: ``bash -n``, then the script itself run with fake ``srun`` / ``scontrol`` on
PATH as a two-"node" allocation: srun starts the script's command once per node, both
torchrun agents meet at the rendezvous the script names, and ``trainpilot train`` trains a
custom model on a custom cluster file that only the script carries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interop.matrix import cases
from trainpilot.plan.slurm import slurm_script
from trainpilot.specs import ClusterSpec, Plan, load_model

FAKE_SRUN = """#!/bin/bash
# Fake srun: run the command once per node of the allocation, as SLURM does.
set -u
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$FAKE_LOG_DIR/node$node.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
# Fake scontrol: `show hostnames LIST` prints one host a line (both "nodes" are this host).
[ "$1 $2" = "show hostnames" ] || exit 1
for ((i = 0; i < SLURM_NNODES; i++)); do echo 127.0.0.1; done
"""


@pytest.mark.parametrize("name,model,plan", cases(), ids=[c[0] for c in cases()])
def test_every_export_passes_bash_n(tmp_path, name, model, plan):
    from trainpilot.specs import load_cluster

    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(plan, model, load_cluster("h100-sxm-x16")))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_bash_n_can_fail(tmp_path):
    """Negative control: a script with a broken heredoc fails ``bash -n``."""
    name, model, plan = cases()[0]
    from trainpilot.specs import load_cluster

    text = slurm_script(plan, model, load_cluster("h100-sxm-x16"))
    script = tmp_path / "bad.sbatch"
    script.write_text(text.replace("srun trainpilot", "srun $(trainpilot", 1))
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode != 0


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_two_node_run_with_fake_srun(tmp_path):
    cluster = ClusterSpec.model_validate(dict(
        name="my-two-box-lab", device="cpu", devices_per_node=1, num_nodes=2,
        network=dict(intra_node=dict(gbytes_per_s=2), inter_node=dict(gbytes_per_s=1),
                     collective_library="gloo")))
    model = load_model("tiny-gpt").replace(name="my-tiny", num_hidden_layers=2)
    plan = Plan(dp=2, zero=0, micro_batch_size=2, global_batch_size=4, seq_len=32)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(plan, model, cluster))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[1-2]",
               SLURM_SUBMIT_DIR=str(tmp_path), FAKE_LOG_DIR=str(tmp_path),
               TRAINPILOT_RDZV_PORT=str(port), OMP_NUM_THREADS="1")
    result = subprocess.run(["bash", str(script), "--steps", "3", "--no-predict"], env=env,
                            capture_output=True, text=True, timeout=220, cwd=tmp_path)
    logs = "\n".join((tmp_path / f"node{i}.log").read_text() for i in range(2)
                     if (tmp_path / f"node{i}.log").exists())
    assert result.returncode == 0, result.stderr + logs
    run_dir = tmp_path / "runs" / "4242"
    assert "name: my-two-box-lab" in (run_dir / "job" / "cluster.yaml").read_text()
    assert (run_dir / "trainpilot.db").exists()
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["layout"]["world_size"] == 2, summary
    assert "my-tiny" in logs  # both agents trained the model only the script carried
