"""Drive ``trainpilot train`` from outside, the way faults happen on a cluster: signals to the
launcher, to one rank or to the whole process group, a disk that fills up, a rerun of the same
command. Every process a test starts lives in its own session and is killed by process id."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

STEPS2, STEPS4 = 12, 12  # the reference runs' lengths (tests/conftest.py)
PLAN2 = "dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64"
PLAN4 = "dp=4,zero=0,micro_batch_size=4,global_batch_size=16,seq_len=64"


def train_args(run_dir: Path, *, steps: int, plan: str = PLAN2, every: int = 3,
               extra: tuple[str, ...] = ()) -> list[str]:
    """The command a user types (heartbeats and collective timeouts tightened for CPU tests)."""
    return [sys.executable, "-m", "trainpilot", "train", "--model", "tiny-gpt", "--steps",
            str(steps), "--checkpoint-every", str(every), "--no-predict", "--plan", plan,
            "--heartbeat-timeout", "2.5", "--collective-timeout", "5", "--run-dir", str(run_dir),
            *extra]


class Job:
    """One ``trainpilot train`` process (the launcher) and what it started."""

    def __init__(self, args: list[str], *, env: dict | None = None, out: Path | None = None):
        self.args = args
        self.out_path = out or Path(args[args.index("--run-dir") + 1] + ".out")
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self.out_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ, **(env or {})))
        self.run_dir = Path(args[args.index("--run-dir") + 1])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def workers(self) -> dict[int, int]:
        """rank -> pid of the launcher's live worker processes."""
        out = {}
        for pid in _children(self.pid):
            env = _environ(pid)
            if env.get("TRAINPILOT_LAUNCHER_PID") == str(self.pid) and "RANK" in env:
                out[int(env["RANK"])] = pid
        return out

    def wait_workers(self, n: int, timeout: float = 60.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.workers()
            if len(found) >= n:
                return found
            self._check_alive()
            time.sleep(0.1)
        raise TimeoutError(f"{n} workers did not start; output:\n{self.output()[-3000:]}")

    def wait_step(self, step: int, timeout: float = 120.0, *, attempt: int | None = None) -> int:
        """Block until rank 0 finished ``step`` (in the given torchrun attempt, if any), as its
        beacon in the launcher's node-local watch folder says (the run's own disk may be
        full)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.beacon_step(attempt=attempt)
            if done >= step:
                return done
            self._check_alive()
            time.sleep(0.05)
        raise TimeoutError(f"step {step} not reached; output:\n{self.output()[-3000:]}")

    def registered(self, attempt: int) -> dict[int, int]:
        """rank -> pid of the workers of torchrun attempt ``attempt`` that registered with the
        launcher's watchdog and are still alive."""
        out = {}
        for folder in Path("/dev/shm").glob(f"trainpilot-{self.pid}-*"):
            for path in folder.glob("rank*.json"):
                if ".exit." in path.name:
                    continue
                try:
                    info = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if info.get("attempt") == attempt and _state(info["pid"]) not in (None, "Z"):
                    out[int(info["rank"])] = int(info["pid"])
        return out

    def wait_registered(self, attempt: int, n: int, timeout: float = 90.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.registered(attempt)
            if len(found) >= n:
                return found
            self._check_alive()
            time.sleep(0.05)
        raise TimeoutError(f"attempt {attempt} did not start; output:\n{self.output()[-3000:]}")

    def beacon_step(self, *, attempt: int | None = None) -> int:
        """The step rank 0's beacon reports (0 before it starts)."""
        best = 0
        for folder in Path("/dev/shm").glob(f"trainpilot-{self.pid}-*"):
            try:
                info = json.loads((folder / "rank0.json").read_text())
                if attempt is not None and info["attempt"] != attempt:
                    continue
                beat = (folder / f"rank0.beat.{info['pid']}").read_text().split()
                best = max(best, int(beat[1]))
            except (OSError, ValueError, KeyError, IndexError):
                continue
        return best

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the launcher ended (rc {self.proc.returncode}) early:\n"
                               f"{self.output()[-3000:]}")

    def wait(self, timeout: float = 240.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.flush()

    def output(self) -> str:
        self._out.flush()
        return self.out_path.read_text(errors="replace")

    def kill_all(self) -> None:
        """SIGKILL the launcher's session (launcher and workers)."""
        pids = [self.pid, *self.workers().values()]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()


@contextlib.contextmanager
def tmpfs(mount: Path, options: str, why: str) -> Iterator[Path]:
    """A tmpfs mounted at ``mount`` (made here) with ``options`` for the block; the test is
    skipped, saying ``why`` it needs one, where this process cannot mount (not root)."""
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount {why} here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@contextlib.contextmanager
def job(args: list[str], **kwargs) -> Iterator[Job]:
    j = Job(args, **kwargs)
    try:
        yield j
    finally:
        if j.proc.poll() is None:
            j.kill_all()
        else:
            with contextlib.suppress(Exception):
                for pid in _orphans(j.pid):
                    os.kill(pid, signal.SIGKILL)
            j._out.close()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def _orphans(launcher_pid: int) -> list[int]:
    """Workers of ``launcher_pid`` still alive anywhere (e.g. after the launcher died)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            if _environ(int(entry.name)).get("TRAINPILOT_LAUNCHER_PID") == str(launcher_pid):
                out.append(int(entry.name))
    return out


def alive_workers_of(launcher_pid: int) -> list[int]:
    return [p for p in _orphans(launcher_pid) if _state(p) not in (None, "Z")]


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def completed_steps(run_dir: Path, *, since_attempt: int | None = None) -> int:
    """The highest step rank 0 streamed to metrics.jsonl (optionally after the restart event of
    torchrun attempt ``since_attempt``)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    best, counting = 0, since_attempt is None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "restart" and since_attempt is not None:
            counting = rec.get("attempt") == since_attempt
        if counting and rec.get("kind") == "step":
            best = max(best, rec["step"])
    return best


def journal(run_dir: Path) -> list[dict]:
    path = run_dir / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def launcher_records(run_dir: Path) -> list[dict]:
    path = run_dir / "launcher.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Model and optimizer of the checkpoint at ``step``, loaded with no process group."""
    from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer

    ckpt = Checkpointer(CheckpointConfig(root_dir=run_dir / "checkpoints"))
    try:
        restored = ckpt.restore_latest(source="storage", restore_rng=False, max_step=step)
    finally:
        ckpt.close()
    found = None if restored is None else restored.step
    assert found == step, f"{run_dir}: the newest storage checkpoint at or before step {step} " \
                          f"is {found}"
    flat = {}
    for section in ("model", "optimizer"):
        flat.update({f"{section}/{k}": v for k, v in restored.state[section].items()
                     if torch.is_tensor(v)})
    return flat


def losses(run_dir: Path) -> dict[int, float]:
    from trainpilot.store import RunStore

    store = RunStore.open_readonly(run_dir)
    try:
        return dict(zip(*store.series("loss")))
    finally:
        store.close()


def events(run_dir: Path, kinds: list[str]) -> list:
    from trainpilot.store import RunStore

    store = RunStore.open_readonly(run_dir)
    try:
        return store.events(kinds=kinds)
    finally:
        store.close()


def assert_same_run(run_dir: Path, reference: Path, *, step: int, num_steps: int | None = None,
                    ) -> None:
    """The oracle: the checkpoint at ``step`` (weights and AdamW state) is torch.equal to the
    uninterrupted run's, and so is the loss of every step (``num_steps`` of them)."""
    got, want = final_state(run_dir, step), final_state(reference, step)
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert differ == [], f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    run_losses, ref_losses = losses(run_dir), losses(reference)
    assert len(ref_losses) == (num_steps or step)
    assert run_losses == ref_losses


def send(pid: int, sig: signal.Signals) -> None:
    os.kill(pid, sig)
