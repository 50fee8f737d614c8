"""The external tier's reference runs are session fixtures of tests/conftest.py (``ref2``,
``ref4``), shared with the elastic tier."""

from tests.external.harness import STEPS2, STEPS4

__all__ = ["STEPS2", "STEPS4"]
