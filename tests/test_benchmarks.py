"""Benchmark entry points fail fast and clearly on bad input (they never hang on a dead worker)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _fails_on_rank_1(rank, world, args):
    if rank == 1:
        raise RuntimeError("boom")
    time.sleep(600)  # rank 0 would wait forever for its peer
    return rank


def test_run_gloo_reports_a_dead_worker_instead_of_hanging():
    from bench_common import WorkerError, run_gloo

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 exit code 1"):
        run_gloo(_fails_on_rank_1, 2, None, timeout=300)
    assert time.monotonic() - t0 < 120
    with pytest.raises(ValueError, match="--nproc=0"):
        run_gloo(_fails_on_rank_1, 0, None)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["geo.power_search=abc"], "geo.power_search='abc'"),
        (["--refresh-interval", "0"], "--refresh-interval=0 must be >= 1"),
        (["--steps", "0"], "--steps=0 must be >= 1"),
        (["comm.transform=none"], "turn comm.transform=geo off"),
    ],
)
def test_geo_overhead_rejects_bad_input_before_starting_workers(argv, message):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/geo_overhead.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dp", "1"], "--dp 1 must be >= 2"),
        (["--presets", "geofp8"], "the geometry-aware presets are not timed here"),
        (["--json", "/nonexistent_dir_x/c.json"], "does not exist"),
        (["--json", "."], "is a folder; give a file name"),
        (["--numel", "3072"], "use at least 3073"),
        (["--device", "meta"], "--device meta: use cpu or cuda"),
    ],
)
def test_codec_benchmark_rejects_bad_input_before_running(argv, message):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/codec.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_codec_benchmark_smallest_bucket_runs():
    """The size the --numel error suggests is accepted (its suggestion used to fail in turn)."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/codec.py"),
            "--numel",
            "3073",
            "--presets",
            "fp8",
            "--repeats",
            "1",
            "--compile",
            "eager",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fp8" in r.stdout and "Traceback" not in r.stderr
