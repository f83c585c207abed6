#!/usr/bin/env bash
# Comm-mode comparison sweep: every preset x seed trained into one sweep folder (see tools/run_comparison.py).
#   scripts/run_comparison.sh --config configs/tiny.yaml --sweep-dir runs/sweep_tiny [--presets bf16 fp8] [--seeds 3]
#   scripts/run_comparison.sh --config configs/llama_600m.yaml --sweep-dir runs/sweep_600m --slurm
# then: python tools/compare_runs.py runs/sweep_tiny
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python
exec "$py" "$here/tools/run_comparison.py" "$@"
