"""The embedded run store: one SQLite database (WAL mode) per run directory.

Rank 0 writes (``RunStore.create``); the dashboard, the report and the CLI read while training
writes (``RunStore.open_readonly``). See docs/health.md for the tables and the API.
"""

from trainpilot.store.knowledge import Experience, consult
from trainpilot.store.runstore import Event, RankTiming, RunInfo, RunStore, store_path
from trainpilot.store.schema import EVENT_KINDS, STORE_FILENAME

__all__ = ["EVENT_KINDS", "Event", "Experience", "RankTiming", "RunInfo", "RunStore",
           "STORE_FILENAME", "consult", "store_path"]
