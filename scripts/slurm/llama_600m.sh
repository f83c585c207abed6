#!/bin/bash
# Llama-600M (seq 2048, global batch 512, Muon) on 64 GH200 nodes with one comm preset:
#   scripts/slurm/llama_600m.sh PRESET [key=value ...]    e.g. PRESET = fp32, bf16, fp8, geofp8, nvfp4
# Environment knobs: see submit_paper.sh (NODES, TIME, PARTITION, ACCOUNT, RUN_DIR, DRY_RUN=1, ...).
exec "$(dirname "${BASH_SOURCE[0]}")/submit_paper.sh" llama_600m "$@"
