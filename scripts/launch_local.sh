#!/bin/bash
# Train on one machine with torchrun: one process per GPU, or NPROC CPU processes (gloo) without GPUs.
# Same arguments and environment knobs as scripts/slurm/pretrain.sbatch:
#
#   scripts/launch_local.sh --config configs/tiny.yaml --config configs/comm/bf16.yaml train.steps=50
#   NPROC=4 MG_CONFIGS="configs/llama_300m.yaml configs/comm/fp8.yaml" scripts/launch_local.sh train.steps=20
#
#   NPROC           processes (default: the number of visible GPUs, or 2 on a machine without GPUs)
#   MG_CONFIGS      config files merged in order, before the arguments' --config files
#   MG_OVERRIDES    dotted overrides, before the arguments' overrides
#   MG_PYTHON       interpreter (default: .venv/bin/python of the repository if present, else python3)
#   MASTER_PORT     rendezvous port on 127.0.0.1 (default 29500)
# Exit code: the training's (0 finished, 2 config/data/launch error, 3 non-finite gradients with
# train.nonfinite=stop, 4 stopped by SIGTERM/SIGUSR1 after a checkpoint; rerun the same command to resume).
# With more than one process torchrun reports a failed child as 1 and prints the child's code.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

if [[ -z "${MG_PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then MG_PYTHON="$ROOT/.venv/bin/python"; else MG_PYTHON=python3; fi
fi
if [[ -z "${NPROC:-}" ]]; then
    if ! NPROC="$("$MG_PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)')"; then
        echo "error: MG_PYTHON=$MG_PYTHON cannot import torch; run 'make install' or set MG_PYTHON" >&2
        exit 2
    fi
fi
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC=$NPROC is not a positive integer (e.g. NPROC=2)" >&2
    exit 2
fi

ARGS=()
for f in ${MG_CONFIGS:-}; do ARGS+=(--config "$f"); done
for o in ${MG_OVERRIDES:-}; do ARGS+=("$o"); done
ARGS+=("$@")

# Slurm variables from an enclosing allocation would make the trainer think srun started it.
for v in $(compgen -e | grep '^SLURM_' || true); do unset "$v"; done
export PYTHONUNBUFFERED=1

echo "[launch_local] $NPROC process(es), python $MG_PYTHON, args: ${ARGS[*]}"
if [[ "$NPROC" == 1 ]]; then
    exec "$MG_PYTHON" pretrain_llama.py "${ARGS[@]}"
fi
exec "$MG_PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 \
    --master-port "${MASTER_PORT:-29500}" pretrain_llama.py "${ARGS[@]}"
