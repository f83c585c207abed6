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
#   DRY_RUN=1                               print the sbatch command instead of submitting
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

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
mkdir -p logs
"${cmd[@]}"
