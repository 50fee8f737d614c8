"""Elastic training: failure detection, in-process recovery, restarts and resizing.

* ``ElasticSession`` (session.py): the process group as generations over the job's store,
  heartbeats, and in-process recovery of a Trainer (new group, state from host memory).
* ``Heartbeat`` (heartbeat.py): silent and hung ranks are declared failed and killed.
* ``retry_collective`` (retry.py): bounded retry of a collective that failed before the wire.
* ``LocalSupervisor`` (local.py): one machine's ranks, each replaced when it dies.
* ``steps.py``: the checkpoint and recovery steps ``Trainer.fit`` runs.
* ``resize.py``: the plan at another world size (elastic ``--nnodes=MIN:MAX``).

docs/elastic.md has the design and the measurements.
"""

from trainpilot.runtime.elastic.config import ElasticConfig
from trainpilot.runtime.elastic.retry import CollectiveFailure, is_recoverable, retry_collective

__all__ = ["CollectiveFailure", "ElasticConfig", "ElasticSession", "Heartbeat",
           "LocalSupervisor", "is_recoverable", "retry_collective"]


def __getattr__(name: str):
    if name == "ElasticSession":
        from trainpilot.runtime.elastic.session import ElasticSession

        return ElasticSession
    if name == "Heartbeat":
        from trainpilot.runtime.elastic.heartbeat import Heartbeat

        return Heartbeat
    if name == "LocalSupervisor":
        from trainpilot.runtime.elastic.local import LocalSupervisor

        return LocalSupervisor
    raise AttributeError(f"module 'trainpilot.runtime.elastic' has no attribute {name!r}")
