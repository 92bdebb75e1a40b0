# Two commands set everything up on a fresh machine:
#   make demo   -> virtual env + install + the main job (digits CNN, ε ≤ 3)
#   make test   -> virtual env + install + the test suite
# torch is pinned to the CPU build through constraints.txt; installing it first keeps pip
# from ever resolving a (multi-GB) CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all bench clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[all,dev,hf]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lightning-dp fit --config configs/digits.yaml

test: $(STAMP)
	$(BIN)/python -m pytest

test-all: $(STAMP)
	LIGHTNING_DP_SLOW=1 $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) lightning_logs *.egg-info
