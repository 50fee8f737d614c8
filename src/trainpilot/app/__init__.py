"""The composition root: one rank of a job built from its job document (``rank.py``), and the
process torchrun starts on every rank (``worker.py``). The only layer that wires runtime,
health and store together; ``trainpilot train``, the recovery drills, the benchmarks and the
tests all go through it, so the oracle exercises the wiring that ships."""
