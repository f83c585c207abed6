"""benchmarks/gpu_check.sh in its CPU dry run: every phase runs, CUDA parts are skipped with the reason
printed, and one JSON file holds the figures."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_writes_one_json(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all phases passed" in r.stdout
    d = json.loads((tmp_path / "gpu_check.json").read_text())
    assert d["dry_run"] is True and d["env"]["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert "tests: skipped (CUDA is not available on this machine)" in r.stdout
        assert "codec: CUDA part skipped: CUDA is not available" in r.stdout
        assert d["tests"] == {"skipped": "CUDA is not available on this machine"}
    ops = d["codec"]["ops"]
    assert set(ops) >= {"copy", "fp8_e4m3 tensor", "nvfp4", "bf16 cast"}
    assert ops["copy"]["ratio_to_copy"] == pytest.approx(1.0) and all(v["gbps"] > 0 for v in ops.values())
    geo = d["geo"]["layers"]["tiny.yaml"]
    assert geo["shape"] == [128, 384] and 0 < geo["geofp8_rel_l2"] < 0.1  # E4M3 round trip: a few percent
    t = d["train_300m"]
    assert t["device"] == "cpu" and t["optimizer"] == "muon" and t["timed_steps"] == 2
    assert t["tokens_per_sec"] > 0 and t["tflops_per_gpu"] > 0 and t["mfu"] is None  # no peak for a CPU
    assert 5.0 < t["first_loss"] < 7.5  # ln(512) = 6.24 at init on the dry run's 512-token vocab
    assert "train_600m, train_600m_geofp8: skipped in the dry run" in r.stdout
    rc = d["reducer_codec"]["presets"]  # the reducer-path codec benchmark ran (eager in the dry run)
    assert set(rc) == {"fp8", "nvfp4"} and all(r["syncs_per_bucket"] == 0 and r["ms"] > 0 for r in rc.values())
    dr = d["dry_run_600m"]
    assert dr["dp"] == 64 and dr["optimizer_steps"] == 2 and abs(dr["measured_over_plan"] - 1) <= 0.1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_without_cuda_needs_dry_run(tmp_path):
    r = subprocess.run(["benchmarks/gpu_check.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "no CUDA device visible" in r.stderr and "--dry-run" in r.stderr
