#!/usr/bin/env python
"""Pretrain a Llama with tensor x data parallelism and a pluggable DP gradient reducer.

python pretrain_llama.py --config configs/tiny.yaml [--config configs/comm/bf16.yaml] [train.steps=20 ...]
torchrun --nproc-per-node 2 pretrain_llama.py --config configs/tiny.yaml
srun python pretrain_llama.py --config configs/llama_600m.yaml
"""

import sys

from megatron_geo.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
