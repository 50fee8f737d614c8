#!/usr/bin/env bash
# Static checks (run by `make test` before the suite): ruff, mypy on src/, and the import
# contract that encodes the layers of DESIGN.md (pyproject.toml: [tool.importlinter]).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
"$BIN/ruff" check src tests benchmarks examples
"$BIN/mypy"
"$BIN/lint-imports"
