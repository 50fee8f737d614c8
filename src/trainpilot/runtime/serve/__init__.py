"""A reference expert-parallel serving loop with token-level retry after a killed rank
(``loop.run_serving``), on the batch-invariant engine of ``engine.py``."""
