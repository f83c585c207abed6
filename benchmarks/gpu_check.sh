#!/bin/bash
# One prepared check for a single-GPU machine (< 8 minutes on an H100/H200/GH200): the tests that need
# CUDA, codec and GeoFP8 overhead on CUDA tensors (GB/s next to a device-to-device copy in the same run),
# a few training steps of llama_300m and llama_600m (tokens/s, peak memory, TFLOP/s, MFU), and the DP = 64
# dry run of llama_600m with Muon (rank 0 of the 64-GPU job on this one GPU, fake process group: peak
# memory next to tools/plan_report.py's persistent figure).
# Every figure goes into one JSON file: <dir>/gpu_check.json, dir = $1, else $OUT, else runs/gpu_check.
#
#   benchmarks/gpu_check.sh [DIR]              on a GPU machine
#   benchmarks/gpu_check.sh --dry-run [DIR]    anywhere: CUDA parts skipped with the reason printed, the
#                                              same code run on the CPU with small sizes (used by the tests)
# Environment: MG_PYTHON (default .venv/bin/python, else python3); GPU_CHECK_COMPILE=1 also times
# llama_600m with per-block torch.compile; per-phase time limits in seconds: T_TESTS T_BENCH T_TRAIN.
# Exit code: 0 when every phase succeeded, 1 otherwise (the JSON still holds what finished).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
DIR="${1:-${OUT:-runs/gpu_check}}"
mkdir -p "$DIR/parts" || exit 2
if [[ -z "${MG_PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then MG_PYTHON=.venv/bin/python; else MG_PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
T_TESTS="${T_TESTS:-150}"; T_BENCH="${T_BENCH:-60}"; T_TRAIN="${T_TRAIN:-120}"; T_DRY="${T_DRY:-120}"

say() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }
failed=()
run_phase() {  # name timeout command...
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS
    say "$name ..."
    timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$DIR/parts/$name.log" 2>&1
    local rc=$?
    tail -n 5 "$DIR/parts/$name.log" | sed "s/^/    /"
    if [[ $rc -ne 0 ]]; then
        failed+=("$name")
        [[ $rc -eq 124 ]] && say "$name: time limit ${limit}s reached" || say "$name: failed with exit code $rc"
        [[ -f "$DIR/parts/$name.json" ]] || printf '{"error": "exit code %d, see parts/%s.log"}\n' "$rc" "$name" > "$DIR/parts/$name.json"
    fi
    say "$name done in $((SECONDS - t0)) s"
}

DRYFLAG=()
if [[ $DRY == 1 ]]; then
    DRYFLAG=(--dry-run)
    say "dry run: CUDA parts are skipped (reason below); the same code runs on the CPU with small sizes"
fi
has_cuda="$("$MG_PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)"
if [[ $DRY == 0 && "$has_cuda" != 1 ]]; then
    echo "error: no CUDA device visible to $MG_PYTHON; run on a GPU machine or use --dry-run" >&2
    exit 2
fi

PY=("$MG_PYTHON" benchmarks/gpu_check.py)
run_phase env 60 "${PY[@]}" env --out "$DIR/parts/env.json"

# 1. the tests that need CUDA (they skip themselves without it)
if [[ "$has_cuda" == 1 && $DRY == 0 ]]; then
    run_phase tests "$T_TESTS" "$MG_PYTHON" -m pytest -q -rs tests/test_gpu_path.py \
        --junitxml "$DIR/parts/tests.xml"
    "$MG_PYTHON" - "$DIR/parts/tests.xml" "$DIR/parts/tests.json" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
try:
    s = ET.parse(sys.argv[1]).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    out = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out["failed_names"] = [c.get("name") for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:  # noqa: BLE001
    out = {"error": f"{type(e).__name__}: {e}"}
json.dump(out, open(sys.argv[2], "w"))
EOF
else
    reason="CUDA is not available on this machine"
    [[ "$has_cuda" == 1 ]] && reason="--dry-run"
    say "tests: skipped ($reason)"
    printf '{"skipped": "%s"}\n' "$reason" > "$DIR/parts/tests.json"
fi

# 2. codec and GeoFP8 overhead on device tensors
run_phase codec "$T_BENCH" "${PY[@]}" codec "${DRYFLAG[@]}" --out "$DIR/parts/codec.json"
run_phase geo "$T_BENCH" "${PY[@]}" geo "${DRYFLAG[@]}" --out "$DIR/parts/geo.json"
# the reducer's own bucket path per preset, eager and compiled (comm.compile), next to a device copy, with a
# bitwise compiled-vs-eager check on this device (issue: codecs at the memory-bandwidth limit)
if [[ $DRY == 1 ]]; then
    run_phase reducer_codec "$T_BENCH" "$MG_PYTHON" benchmarks/codec.py --device cpu --numel 1048576 --repeats 1 \
        --compile eager --presets fp8 nvfp4 --json "$DIR/parts/reducer_codec.json"
else
    run_phase reducer_codec "$((T_BENCH * 3))" "$MG_PYTHON" benchmarks/codec.py --device cuda --numel 67108864 \
        --repeats 10 --json "$DIR/parts/reducer_codec.json"
fi

# 3. a few training steps on one GPU (global batch 8 = 2 micro-batches of 4; paper's seq lengths)
run_phase train_300m "$T_TRAIN" "${PY[@]}" train "${DRYFLAG[@]}" --config configs/llama_300m.yaml \
    --out "$DIR/parts/train_300m.json"
if [[ $DRY == 1 ]]; then
    say "train_600m, train_600m_geofp8: skipped in the dry run (the same code path as train_300m)"
else
    run_phase train_600m "$T_TRAIN" "${PY[@]}" train --config configs/llama_600m.yaml \
        --out "$DIR/parts/train_600m.json"
    run_phase train_600m_geofp8 "$T_TRAIN" "${PY[@]}" train --config configs/llama_600m.yaml \
        --comm geofp8 --out "$DIR/parts/train_600m_geofp8.json"
    if [[ "${GPU_CHECK_COMPILE:-0}" == 1 ]]; then
        run_phase train_600m_compile "$T_TRAIN" "${PY[@]}" train --config configs/llama_600m.yaml \
            --compile --out "$DIR/parts/train_600m_compile.json"
    fi
fi

# 4. rank 0 of the users' DP = 64 job (shapes, plan, memory) on this device
if [[ $DRY == 1 ]]; then
    run_phase dry_run_600m "$T_DRY" "$MG_PYTHON" tools/dry_run.py --config configs/llama_600m.yaml --dp 64 \
        --steps 2 model.num_layers=2 model.seq_length=16 train.global_batch_size=64 train.micro_batch_size=1 \
        train.device=cpu --json "$DIR/parts/dry_run_600m.json"
else
    run_phase dry_run_600m "$T_DRY" "$MG_PYTHON" tools/dry_run.py --config configs/llama_600m.yaml --dp 64 \
        --steps 2 --json "$DIR/parts/dry_run_600m.json"
fi

if ! "${PY[@]}" merge "${DRYFLAG[@]}" --out "$DIR/gpu_check.json" "$DIR"/parts/*.json; then
    say "could not merge the figures into $DIR/gpu_check.json"
    exit 1
fi
say "figures: $DIR/gpu_check.json (per-phase logs in $DIR/parts/)"
"$MG_PYTHON" - "$DIR/gpu_check.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("train") and isinstance(v, dict) and "tokens_per_sec" in v:
        mfu = f"{100 * v['mfu']:.1f}%" if v.get("mfu") is not None else "n/a"
        mem = f"{v['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in v else "n/a"
        print(f"  {k:<20} {v['tokens_per_sec']:>12,.0f} tok/s  {v['tflops_per_gpu']:8.2f} TFLOP/s  MFU {mfu:>6}  peak {mem}")
r = d.get("dry_run_600m", {})
if "persistent_bytes" in r:
    peak = f", CUDA peak {r['cuda_max_memory_allocated'] / 2**30:.1f} GiB" if "cuda_max_memory_allocated" in r else ""
    print(f"  dry run DP=64 rank 0: persistent {r['persistent_bytes']['total'] / 2**30:.2f} GiB "
          f"(plan x{r.get('measured_over_plan', float('nan')):.3f}){peak}, {r['optimizer_steps']} optimizer steps")
c = d.get("codec", {}).get("ops", {})
for name, r in c.items():
    print(f"  codec {name:<22} {r['gbps']:9.1f} GB/s  x{r['ratio_to_copy']:.3f} of copy")
EOF
if (( ${#failed[@]} )); then
    say "failed phases: ${failed[*]}"
    exit 1
fi
say "all phases passed"
