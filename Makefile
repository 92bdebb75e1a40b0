# Two commands set everything up on a fresh machine:
#   make demo   -> virtual env + the library with what the main job needs ([all]: CLI, data, report)
#                  + the main job (digits CNN, ε ≤ 3)
#   make test   -> the same, plus the test and Hugging Face extras ([dev,hf]) + the test suite
#                  (and the docs [docs] and lint [lint] extras where they install; without them those tests skip)
#   make docs   -> the documentation site, built strictly into site/ (mkdocs.yml)
# Each install has its own stamp: `make demo` never installs pytest, transformers or peft; `make test`
# after it adds them; `make test` alone does both steps.
# torch is pinned to the CPU build through constraints.txt; installing it first keeps pip
# from ever resolving a (multi-GB) CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
# pytest-xdist workers for `make test` (2: the CI machine's cores; TEST_WORKERS=0 runs in one process)
TEST_WORKERS ?= 2
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: install install-test demo test test-all docs bench clean

$(DEMO_STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[all]"
	touch $(DEMO_STAMP)

$(TEST_STAMP): $(DEMO_STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[all,dev,hf]"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[docs]" || echo "mkdocs not installable here: the docs build test will skip"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[lint]" || echo "ruff not installable here: the lint test will skip"
	touch $(TEST_STAMP)

$(DOCS_STAMP): $(DEMO_STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[docs]"
	touch $(DOCS_STAMP)

install: $(DEMO_STAMP)

install-test: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/lightning-dp fit --config configs/digits.yaml

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

test-all: $(TEST_STAMP)
	LIGHTNING_DP_SLOW=1 $(BIN)/python -m pytest -n $(TEST_WORKERS)

docs: $(DOCS_STAMP)
	$(BIN)/python -m mkdocs build --strict -d site

clean:
	rm -rf $(VENV) lightning_logs *.egg-info site
