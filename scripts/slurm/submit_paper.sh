#!/bin/bash
# Submit one of the paper's runs: MODEL (llama_300m | llama_600m) x comm PRESET (a file in configs/comm/)
# on 64 GH200 nodes, one GPU and one training process per node, through pretrain.sbatch.
#
#   scripts/slurm/submit_paper.sh llama_600m geofp8 [key=value ...]     (or the llama_*.sh wrappers)
#
# Environment (all optional):
#   NODES=64  GPUS_PER_NODE=1 (0: no --gpus-per-node, for clusters that give whole nodes without GRES)
#   CPUS_PER_TASK=72 (a GH200's Grace CPU)  TIME=24:00:00  PARTITION=  ACCOUNT=  QOS=
#   RUN_DIR=runs/<model>_<preset>_n<nodes>  (a requeued or resubmitted job resumes from its checkpoints)
#   SBATCH_EXTRA="--exclusive ..."          more sbatch options
#   MG_CONTAINER_IMAGE, NCCL_* ...          passed through to the job (see pretrain.sbatch)
#   DRY_RUN=1                               print the sbatch command instead of submitting (1/true/yes)
#   MG_VALIDATE=0                           skip the config check before submitting
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

usage() { echo "usage: $0 llama_300m|llama_600m PRESET [key=value ...]; presets: $(ls configs/comm | sed 's/\.yaml$//' | tr '\n' ' ')" >&2; }
if [[ $# -lt 2 ]]; then usage; exit 2; fi
model="$1"; preset="${2%.yaml}"; shift 2
if [[ ! -f "configs/$model.yaml" || ( "$model" != llama_300m && "$model" != llama_600m ) ]]; then
    echo "error: model '$model' is not one of llama_300m, llama_600m" >&2; usage; exit 2
fi
if [[ ! -f "configs/comm/$preset.yaml" ]]; then
    echo "error: comm preset '$preset' not found in configs/comm/" >&2; usage; exit 2
fi

nodes="${NODES:-64}"; gpus="${GPUS_PER_NODE:-1}"
for v in nodes gpus; do
    if ! [[ "${!v}" =~ ^[0-9]+$ ]]; then echo "error: ${v^^}=${!v} is not a non-negative integer" >&2; exit 2; fi
done
if (( nodes < 1 )); then echo "error: NODES=$nodes must be >= 1" >&2; exit 2; fi
tasks=$(( gpus > 0 ? gpus : 1 ))
run_dir="${RUN_DIR:-runs/${model}_${preset}_n${nodes}}"

cmd=(sbatch --job-name="${model#llama_}-${preset}" --nodes="$nodes" --ntasks-per-node="$tasks"
     --cpus-per-task="${CPUS_PER_TASK:-72}" --time="${TIME:-24:00:00}")
(( gpus > 0 )) && cmd+=(--gpus-per-node="$gpus")
[[ -n "${PARTITION:-}" ]] && cmd+=(--partition="$PARTITION")
[[ -n "${ACCOUNT:-}" ]] && cmd+=(--account="$ACCOUNT")
[[ -n "${QOS:-}" ]] && cmd+=(--qos="$QOS")
# shellcheck disable=SC2206
[[ -n "${SBATCH_EXTRA:-}" ]] && cmd+=(${SBATCH_EXTRA})
cmd+=(scripts/slurm/pretrain.sbatch --config "configs/$model.yaml" --config "configs/comm/$preset.yaml"
      "train.run_dir=$run_dir" "logging.wandb_name=${model}-${preset}-n${nodes}" "$@")

case "${DRY_RUN:-0}" in
    1|true|yes|on) dry=1 ;;
    0|false|no|off|"") dry=0 ;;
    *) echo "error: DRY_RUN=$DRY_RUN; use DRY_RUN=1 (print the sbatch command) or DRY_RUN=0" >&2; exit 2 ;;
esac
# validate the resolved config for the job's world size here, before anything is queued (exit 2 on a bad key;
# MG_VALIDATE=0 skips it, e.g. on a login node without the project's Python)
py="${MG_PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
if [[ "${MG_VALIDATE:-1}" != 0 ]] && command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch" >/dev/null 2>&1; then
    RANK=0 WORLD_SIZE=$((nodes * tasks)) "$py" pretrain_llama.py --config "configs/$model.yaml" \
        --config "configs/comm/$preset.yaml" "train.run_dir=$run_dir" "$@" --print-config >/dev/null || exit 2
fi
# where the run writes (checkpoint.dir defaults to <train.run_dir>/checkpoints; a checkpoint.dir=... override wins)
ckpt_dir="$run_dir/checkpoints"
for kv in "$@"; do [[ "$kv" == checkpoint.dir=* ]] && ckpt_dir="${kv#checkpoint.dir=}"; done
echo "run folder: $run_dir | checkpoints: $ckpt_dir (every checkpoint.interval steps; a resubmitted job resumes)" >&2
if (( dry )); then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
mkdir -p logs
"${cmd[@]}"
