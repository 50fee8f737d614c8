# The README's two commands. Both do all set-up on a fresh machine.
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
# DeepSpeed (a test extra, for its config validator) installs without building any kernel.
export DS_BUILD_OPS ?= 0
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]' 2>&1 | { grep -v '^WARNING: Location' || true; }
	$(PYTHON) -c "import trainpilot, torch; print('trainpilot', trainpilot.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/trainpilot demo

test: setup
	bash scripts/install_browser.sh
	bash scripts/install_netns.sh
	VENV=$(VENV) bash scripts/check.sh
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup --durations=25

clean:
	rm -rf $(VENV) .pytest_cache
