"""Uninterrupted reference runs, made once per session through ``trainpilot train`` itself."""

from __future__ import annotations

import pytest

from tests.external.harness import PLAN2, PLAN4, job, train_args

STEPS2, STEPS4 = 12, 12


@pytest.fixture(scope="session")
def ref2(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "ref2"
    with job(train_args(run_dir, steps=STEPS2, plan=PLAN2)) as j:
        assert j.wait() == 0, j.output()[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def ref4(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "ref4"
    with job(train_args(run_dir, steps=STEPS4, plan=PLAN4)) as j:
        assert j.wait() == 0, j.output()[-3000:]
    return run_dir
