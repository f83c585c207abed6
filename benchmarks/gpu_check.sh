#!/bin/bash
# One prepared check for a single-GPU machine, at most 8 minutes in all (one overall `timeout`): checkpoint save and
# resume on the GPU; GeoFP8 refreshes under autocast, the overlapped parameter gather and train.compile, each at
# DP = 2 on the fake process group (this process is rank 0 of 2 on the one GPU); the parameter gather's plain BF16
# against its fp8 / nvfp4 difference on Llama-600M buckets (encode, decode and apply, bytes; DP 1 and 2); the tests
# that need CUDA; Llama-600M throughput and MFU; the codecs next to a device-to-device copy. Each phase runs in its
# own process with its own time limit (benchmarks/gpu_check.py lists them and their budgets, 450 s in all).
#
#   benchmarks/gpu_check.sh [DIR]              on a GPU machine
#   benchmarks/gpu_check.sh --dry-run [DIR]    anywhere: the same phases on the CPU with small sizes, the CUDA
#                                              parts skipped with the reason in the JSON (used by the tests)
#
# Output: exactly two files in DIR (default $OUT, else runs/gpu_check), rebuilt after every phase, so a run stopped
# at any point leaves what finished: gpu_check.json (one entry per phase: status, seconds, limit, figures, checks,
# the error and log tail of a phase that did not pass) and gpu_check_logs.tar.gz (every phase's log).
# Interpreter: $MG_PYTHON, else the machine's python3 (a .venv in the checkout is never used on its own: one built on
# another machine may lack CUDA). No install needed: the repository root goes on PYTHONPATH.
# Environment: GPU_CHECK_TIMEOUT overall limit in seconds (default 470, plus 10 s to stop); GPU_CHECK_ONLY,
# GPU_CHECK_LIMITS, GPU_CHECK_LAUNCH, GPU_CHECK_KEEP_WORK: see benchmarks/gpu_check.py.
# Exit code: 0 every phase passed, 1 some did not, 2 no CUDA device without --dry-run (or a bad setting),
# 124 stopped by the overall limit (or another SIGTERM / SIGINT).
set -uo pipefail

DRY=()
POS=()
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=(--dry-run) ;;
        -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "error: unknown option $a; use --dry-run or --help" >&2; exit 2 ;;
        *) POS+=("$a") ;;
    esac
done
if (( ${#POS[@]} > 1 )); then
    echo "error: one output folder expected, got ${#POS[@]}: ${POS[*]}" >&2
    exit 2
fi
DIR="${POS[0]:-${OUT:-runs/gpu_check}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ "$DIR" == /* ]] || DIR="$PWD/$DIR"   # relative to where the script was called from
PY="${MG_PYTHON:-python3}"
if ! PYBIN="$(command -v "$PY")"; then
    echo "error: interpreter '$PY' not found (MG_PYTHON=${MG_PYTHON:-unset}); install python3 or set MG_PYTHON" >&2
    exit 2
fi
[[ "$PYBIN" == /* ]] || PYBIN="$PWD/$PYBIN"
# the interpreter must be a Python that imports torch (not e.g. a system python3 without it, or /bin/true)
if [[ "$("$PYBIN" -c 'import torch; print("torch-ok")' 2>/dev/null | tail -n 1)" != "torch-ok" ]]; then
    echo "error: '$PYBIN' (MG_PYTHON=${MG_PYTHON:-unset}) is not a Python that can import torch; set MG_PYTHON to" \
         "one that can (e.g. MG_PYTHON=.venv/bin/python after make install)" >&2
    exit 2
fi
LIMIT="${GPU_CHECK_TIMEOUT:-470}"
if ! [[ "$LIMIT" =~ ^[0-9]+$ ]] || (( LIMIT < 1 )); then
    echo "error: GPU_CHECK_TIMEOUT=$LIMIT must be a whole number of seconds >= 1 (default 470)" >&2
    exit 2
fi
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 WANDB_MODE=disabled
exec timeout --signal=TERM --kill-after=10 "$LIMIT" \
    "$PYBIN" benchmarks/gpu_check.py run "${DRY[@]}" --python "$PYBIN" --overall-s "$LIMIT" "$DIR"
