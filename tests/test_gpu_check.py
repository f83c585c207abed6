"""benchmarks/gpu_check.sh: its CPU dry run (every phase, exactly two output files), its time limits (per phase, the
overall one, a stop signal: the JSON is valid each time) and its choice of interpreter (the machine's python3 or
MG_PYTHON, never a .venv found in the checkout)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
PHASES = ["env", "checkpoint", "geo", "overlap", "param_gather", "compile", "cuda_tests", "train_600m", "codec"]
OUTPUTS = {"gpu_check.json", "gpu_check_logs.tar.gz"}


PROBE = '-c import torch; print("torch-ok")'  # the script's check that the interpreter imports torch


def _runs(calls: Path) -> list[str]:
    """The logged interpreter calls after the script's torch probe, which must come first."""
    lines = calls.read_text().splitlines()
    assert lines and lines[0] == PROBE, lines[:2]
    return lines[1:]


def _python3_on_path(tmp_path: Path, name: str = "python3") -> tuple[Path, Path]:
    """A ``python3`` (first on PATH) that logs each call and runs this interpreter; returns (its path, its log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"{name}.calls"
    exe = bin_dir / name
    exe.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{sys.executable}" "$@"\n')
    exe.chmod(0o755)
    return exe, log


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k not in ("MG_PYTHON", "OUT")}
    env["PATH"] = f"{tmp_path / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


def _run(args, env, timeout=300):
    t0 = time.monotonic()
    r = subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def _outputs(out: Path) -> tuple[dict, set[str]]:
    assert {p.name for p in out.iterdir()} == OUTPUTS  # exactly the two files, nothing else
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        members = {m.name for m in tar.getmembers()}
    return json.loads((out / "gpu_check.json").read_text()), members


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One full dry run with the machine's python3 (a logging stand-in first on PATH) and MG_PYTHON unset, while this
    checkout has a .venv of its own."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    exe, calls = _python3_on_path(tmp)
    out = tmp / "out"
    r, secs = _run(["--dry-run", str(out)], _env(tmp))
    return SimpleNamespace(r=r, secs=secs, out=out, exe=exe, calls=calls)


def test_dry_run_writes_two_files_with_every_phase(dry_run):
    r = dry_run.r
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all phases passed" in r.stdout
    d, members = _outputs(dry_run.out)
    assert d["dry_run"] is True and d["finished"] is True and d["failed"] == []
    assert d["phase_order"] == PHASES
    for name in PHASES:
        assert d[name]["status"] == "ok", (name, d[name])
        assert all(d[name]["checks"].values()), (name, d[name]["checks"])
        assert f"gpu_check_logs/{name}.log" in members
        assert d[name]["log"] == f"gpu_check_logs/{name}.log"
    # one overall limit: the phase budgets fit in it with the time to stop, 8 minutes with the 10 s kill margin
    assert sum(d["budgets_s"].values()) <= 450 and d["overall_limit_s"] + 10 <= 480
    assert set(d["budgets_s"]) == set(PHASES)
    if not torch.cuda.is_available():
        for name in ("checkpoint", "geo", "overlap", "param_gather", "compile", "train_600m", "codec"):
            assert d[name]["cuda_skipped"].startswith("CUDA is not available on this machine"), name
        assert d["cuda_tests"]["cuda_skipped"].startswith("CUDA is not available")


def test_dry_run_uses_the_machines_python3_not_the_checkouts_venv(dry_run):
    d = json.loads((dry_run.out / "gpu_check.json").read_text())
    assert d["python"] == str(dry_run.exe)
    assert ".venv" not in d["python"]
    calls = _runs(dry_run.calls)
    assert calls and all("benchmarks/gpu_check.py" in c for c in calls)
    assert calls[0].split()[1:3] == ["run", "--dry-run"]


def test_dry_run_figures(dry_run):
    d = json.loads((dry_run.out / "gpu_check.json").read_text())
    env = d["env"]
    assert env["torch"] == torch.__version__ and env["cuda_available"] == torch.cuda.is_available()
    # every module imports with wandb / datasets / lm_eval blocked, except ones that exist for such a package
    assert env["modules_imported"] > 50
    for mod, why in env["modules_needing_an_optional_package"].items():
        assert why in ("needs wandb", "needs datasets", "needs lm_eval"), (mod, why)
        assert not mod.startswith(("megatron_geo.training", "megatron_geo.model", "megatron_geo.comm")), mod

    ck = d["checkpoint"]["adamw_fp32"]  # 4 steps as 2 + 2: resumed at 2, ran to 4, the same losses on the CPU
    assert ck["resumed_start_step"] == 2 and ck["resumed_steps"] == 4 and ck["first_launch_steps"] == 2
    assert ck["resumed_losses"] == {k: v for k, v in ck["reference_losses"].items() if int(k) > 2}
    assert set(ck["state_devices_after_resume"]["optimizer_state"]) == {"cpu"}

    geo = d["geo"]
    assert geo["refresh_steps"] == list(range(0, geo["steps"], geo["refresh_interval"]))
    assert geo["refreshes_in_metrics"] == len(geo["refresh_steps"]) == geo["expected_refreshes"]
    assert geo["factor_dtypes"] == geo["transform_dtypes"] == ["torch.float32"]
    layer = geo["layers"]["tiny.yaml"]  # the E4M3 round trip in GeoFP8 coordinates: a few percent
    assert layer["shape"] == [128, 384] and 0 < layer["geofp8_rel_l2"] < 0.1

    on, off = d["overlap"]["overlap_on"], d["overlap"]["overlap_off"]
    assert on["overlap_param_gather"] is True and off["overlap_param_gather"] is False
    assert on["median"]["gathers_in_flight_after_publish"] == on["buckets"]  # every bucket's gather left running
    assert off["median"]["gathers_in_flight_after_publish"] == 0 and off["median"]["waits_in_forward"] == 0
    assert on["median"]["publish_to_first_wait_ms"] >= 0 and on["median"]["first_wait_ms"] >= 0

    _check_param_gather(d["param_gather"])

    c = d["compile"]
    assert c["compiled_blocks"] == c["num_layers"] > 0 and c["unique_graphs"] >= 1
    assert len(c["refresh_steps"]) == c["expected_refreshes"] and isinstance(c["recompiles"], int)

    t = d["cuda_tests"]
    names = {case["test"] for case in t["cases"]}
    assert "tests.test_gpu_path::test_cuda_step_on_one_gpu_bf16_autocast" in names
    assert "tests.test_gpu_path::test_mfu_values_for_llama_600m" not in names  # a CPU test: deselected
    if not torch.cuda.is_available():
        assert t["skipped"] == t["tests"] > 0 and t["failed"] == t["errors"] == 0

    m = d["train_600m"]
    assert m["config"] == "configs/llama_600m.yaml" and m["optimizer"] == "muon" and m["timed_steps"] == 2
    assert m["tokens_per_sec"] > 0 and m["tflops_per_gpu"] > 0
    assert m["mfu"] is None and "not in megatron_geo.training.mfu.PEAK_BF16_FLOPS" in m["peak_source"]
    assert abs(m["first_loss"] - math.log(512)) < 1.0  # uniform over the dry run's 512-token vocab at init
    # Megatron-LM's FLOP count of the dry run's model (h 64, 2 layers, 16 heads of 4, 8 KV heads, MLP 128, seq 64,
    # vocab 512), by hand: 6 x (2 x (q, o 64 x 64; k, v 64 x 32; MLP 3 x 64 x 128) + output 512 x 64) + 12 x 2 x 64 x 64
    assert m["flops_per_token"] == 6 * (2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 512 * 64) + 12 * 2 * 64 * 64
    assert m["flops_per_token"] == 737_280 and "Megatron-LM" in m["flops_convention"]
    ns = m["newton_schulz"]  # every Muon matrix of the 2-layer dry-run model, both forms, beside the step time
    assert ns["matrices"] == 14 and ns["quintic_s"] > 0 and ns["gram_s"] > 0
    assert ns["quintic_share_of_step"] == pytest.approx(ns["quintic_s"] / m["step_time_s_median"])
    # the step with a DP 64 rank's share of the Newton-Schulz (1/64 of it) next to the DP 1 step's (all of it)
    eq = m["dp64_equivalent"]
    assert eq["dp"] == 64 and eq["newton_schulz_share"] == 1 / 64 and "1/64" in eq["method"]
    assert eq["step_time_s"] == pytest.approx(m["step_time_s_median"] - ns["quintic_s"] * (1 - 1 / 64))
    assert eq["tokens_per_sec"] > m["tokens_per_sec"] and eq["mfu"] is None  # no MFU on the CPU
    busy = eq["busiest_rank"]  # the shard plan's busiest DP 64 rank owns at least the mean share
    assert busy["newton_schulz_share"] >= 1 / 64 and busy["step_time_s"] >= eq["step_time_s"]
    assert m["muon_overlap"] is True and m["early_muon_hits"] + m["early_muon_misses"] > 0  # DP 1 owns every matrix

    k = d["codec"]
    assert k["ops"]["copy"]["time_over_copy"] == pytest.approx(1.0)
    assert {"fp8_e4m3 tensor", "nvfp4", "bf16 cast", "hadamard128 rot+inv"} <= set(k["ops"])
    for op in k["ops"].values():  # one convention: time / the copy's time
        assert op["time_over_copy"] == pytest.approx(op["ms"] / k["ops"]["copy"]["ms"])
    rows = k["reducer"]["presets"]
    from megatron_geo.config.presets import codec_presets

    # every preset without a learned transform has its eager row, in the dry run as on a GPU
    assert k["presets"] == list(rows) and set(rows) == set(codec_presets()) and "compiled_skipped" in k
    assert {"fp32", "bf16", "fp8", "fp8_block", "fp8_e5m2", "fp8_ef", "nvfp4"} <= set(rows)
    assert all(r["eager"]["ms"] > 0 and r["eager"]["syncs_per_bucket"] == 0 for r in rows.values())
    for r in rows.values():
        e = r["eager"]
        assert e["time_over_copy"] == pytest.approx(e["ms"] / e["memcpy_ms"]) and e["time_over_copy"] > 1
    for op in geo["layers"]["tiny.yaml"]["ops"].values():
        assert op["time_over_copy"] == pytest.approx(op["ms"] / geo["layers"]["tiny.yaml"]["ops"]["copy"]["ms"])
    assert not _keys_containing(d, "ratio_to"), _keys_containing(d, "ratio_to")  # no second convention
    # the decode-and-mean of every codec at DP 2, 3 and 64 against the FP64-based reference (eager in the dry run)
    dpc = k["decode_dp"]
    assert dpc["dp_sizes"] == [2, 3, 64] and dpc["compiled"] is False
    assert set(dpc["codecs"]) == {"fp8_e4m3 granule16", "fp8_e4m3 granule128", "fp8_e5m2 granule16", "nvfp4"}
    for per_dp in dpc["codecs"].values():
        assert per_dp == {f"dp{n}": {"eager_differing_from_reference": 0} for n in (2, 3, 64)}


GATHER_MODES = ("bf16", "fp8", "nvfp4")
GATHER_PARTS = ("encode", "decode_apply", "total")


def _check_param_gather(g: dict) -> None:
    """The param_gather phase's figures: per DP size, the median and the largest bucket of llama_600m's layout (the
    dry run's small model), every mode's parts over the bucket's copy, its bytes, and the quantised deviation."""
    assert g["config"] == "configs/llama_600m.yaml" and g["param_dtype"] == "bf16"
    assert g["modes"] == list(GATHER_MODES) and g["dp_sizes"] == [1, 2] and g["out_of_budget"] == []
    assert "fake process group" in g["note"] and "one rank" in g["note"]
    for dp in (1, 2):
        e = g[f"dp{dp}"]
        assert len(e["bucket_numels"]) == e["buckets_in_layout"] > 1
        assert e["largest"]["numel"] == max(e["bucket_numels"])
        for label in ("median", "largest"):
            r = e[label]
            n, own = r["numel"], r["owned_numel"]
            assert n % 128 == 0 and own % 128 == 0 and (own == n if dp == 1 else 0 <= own < n)
            assert r["copy"]["ms"] > 0 and r["copy"]["bytes"] == 2 * n
            assert set(r["modes"]) == set(GATHER_MODES)
            for m, x in r["modes"].items():
                for part in GATHER_PARTS:  # one convention: time / the bucket copy's time
                    assert x[part]["ms"] > 0
                    assert x[part]["time_over_copy"] == pytest.approx(x[part]["ms"] / r["copy"]["ms"])
                assert x["total"]["ms"] == pytest.approx(x["encode"]["ms"] + x["decode_apply"]["ms"])
                bpe = {"bf16": 2.0, "fp8": 132 / 128, "nvfp4": 76 / 128}[m]
                assert x["wire_bytes_per_element"] == bpe and x["bucket_bytes"] == n * bpe
                assert x["bytes_vs_bf16"] == pytest.approx(bpe / 2)
                assert x["bytes_sent"] == (n - own) * bpe  # S - own, as a ring all-gather sends
                # one step's difference: within about a BF16 ulp at fp8, a few at nvfp4 (the plain gather has none)
                assert ("max_ulps" in x) == (m != "bf16") and 0 <= x.get("max_ulps", 0) <= {"fp8": 1, "nvfp4": 4}.get(
                    m, 0
                )


def test_param_gather_phase_out_of_budget_names_the_buckets_it_left(tmp_path, monkeypatch):
    """With time for the first bucket only, the phase times it and names every other one in ``out_of_budget``, each
    row with the reason, instead of running into its limit."""
    P = _phases()
    import torch.distributed as dist

    if dist.is_initialized():  # the phase makes its own (fake) groups, as in its own process on a device
        dist.destroy_process_group()
    left = iter([1000.0])
    monkeypatch.setattr(P.Ctx, "time_left", staticmethod(lambda: next(left, 0.5)))
    rec = P.Record(str(tmp_path / "param_gather.json"))
    P.phase_param_gather(P.Ctx(True, str(tmp_path)), rec)
    d = json.loads((tmp_path / "param_gather.json").read_text())
    assert d["checks"] and all(d["checks"].values()), d["checks"]
    assert set(d["dp1"]["median"]["modes"]) == set(GATHER_MODES)
    skipped = [(dp, k) for dp in ("dp1", "dp2") for k in ("median", "largest") if "skipped" in d[dp][k]]
    assert skipped == [("dp1", "largest"), ("dp2", "median"), ("dp2", "largest")]
    assert len(d["out_of_budget"]) == 3 and all("s left of the phase's time limit" in s for s in d["out_of_budget"])
    assert not dist.is_initialized()  # the phase leaves no process group behind


def _keys_containing(obj, text: str, path: str = "") -> list[str]:
    """Paths of the dict keys in ``obj`` (nested dicts and lists) that contain ``text``."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += [f"{path}/{k}"] if text in str(k) else []
            out += _keys_containing(v, text, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _keys_containing(v, text, f"{path}/{i}")
    return out


def test_phase_past_its_budget_is_timed_out_and_the_json_stays_valid(tmp_path):
    exe, calls = _python3_on_path(tmp_path, "mypython")
    out = tmp_path / "out"
    env = _env(
        tmp_path,
        MG_PYTHON=str(exe),
        GPU_CHECK_LAUNCH="exec",
        GPU_CHECK_ONLY="checkpoint,geo",
        GPU_CHECK_STALL="checkpoint=120,geo=120",
        GPU_CHECK_LIMITS="checkpoint=2,geo=3",
    )
    r, secs = _run(["--dry-run", str(out)], env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert secs < 60  # both phases cut at their limits, not after their 120 s sleeps
    d, members = _outputs(out)
    assert d["failed"] == ["checkpoint", "geo"] and d["finished"] is True  # it ran to its end
    for name, limit in (("checkpoint", 2), ("geo", 3)):
        e = d[name]
        assert e["status"] == "timed_out" and e["limit_s"] == limit and limit <= e["seconds"] < limit + 15
        assert f"time limit {limit} s reached" in e["error"] and f"gpu_check_logs/{name}.log" in members
    for name in set(PHASES) - {"checkpoint", "geo"}:
        assert d[name]["status"] == "skipped" and "GPU_CHECK_ONLY" in d[name]["reason"]
    # MG_PYTHON ran the runner and each phase
    assert len(_runs(calls)) == 3 and d["python"] == str(exe)


def test_overall_limit_cuts_the_running_phase(tmp_path):
    out = tmp_path / "out"
    env = _env(
        tmp_path,
        MG_PYTHON=sys.executable,
        GPU_CHECK_LAUNCH="exec",
        GPU_CHECK_TIMEOUT="12",
        GPU_CHECK_ONLY="checkpoint,geo",
        GPU_CHECK_STALL="checkpoint=120",
    )
    r, secs = _run(["--dry-run", str(out)], env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert secs < 12 + 10  # the overall limit and the kill margin
    d, _ = _outputs(out)
    assert d["overall_limit_s"] == 12
    ck = d["checkpoint"]
    assert ck["status"] == "timed_out" and ck["limit_s"] < ck["budget_s"] and "overall limit" in ck["error"]
    assert d["geo"]["status"] == "skipped" and "no time left" in d["geo"]["reason"]
    assert d["failed"] == ["checkpoint", "geo"]


def test_a_stop_signal_records_the_running_phase(tmp_path):
    out = tmp_path / "out"
    env = _env(
        tmp_path,
        MG_PYTHON=sys.executable,
        GPU_CHECK_LAUNCH="exec",
        GPU_CHECK_ONLY="checkpoint,geo",
        GPU_CHECK_STALL="checkpoint=120",
    )
    p = subprocess.Popen(
        [str(SCRIPT), "--dry-run", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the JSON is there and valid while the phase runs
            try:
                if json.loads((out / "gpu_check.json").read_text())["checkpoint"]["status"] == "running":
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the checkpoint phase never showed as running")
        p.send_signal(signal.SIGTERM)  # what the overall timeout (or the machine's command limit) sends
        stdout, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 124, stdout
    d, members = _outputs(out)
    assert d["checkpoint"]["status"] == "stopped" and "SIGTERM" in d["checkpoint"]["error"]
    assert d["geo"]["status"] == "pending" and d["failed"] == ["checkpoint"] and d["finished"] is False
    assert "gpu_check_logs/checkpoint.log" in members


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_the_run_is_refused(tmp_path):
    exe, calls = _python3_on_path(tmp_path)
    out = tmp_path / "out"
    r, _ = _run([str(out)], _env(tmp_path), timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no CUDA device visible to" in r.stderr and "--dry-run" in r.stderr
    d, members = _outputs(out)
    assert d["env"]["status"] == "ok" and d["env"]["cuda_available"] is False
    assert all(d[n]["status"] == "skipped" for n in PHASES[1:]) and "gpu_check_logs/env.log" in members
    assert len(_runs(calls)) == 2  # the runner, then the env phase: each a new python3


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("GPU_CHECK_ONLY", "env,nope", "unknown phase 'nope'"),
        ("GPU_CHECK_LIMITS", "geo=-1", "must be PHASE=SECONDS with SECONDS > 0"),
        ("GPU_CHECK_TIMEOUT", "soon", "GPU_CHECK_TIMEOUT=soon must be a whole number"),
        ("GPU_CHECK_LAUNCH", "spawn", "GPU_CHECK_LAUNCH='spawn'"),
        ("MG_PYTHON", "/nonexistent/python", "interpreter '/nonexistent/python' not found"),
        ("MG_PYTHON", "/bin/true", "is not a Python that can import torch; set MG_PYTHON"),
    ],
)
def test_bad_settings_are_refused(tmp_path, var, value, message):
    env = _env(tmp_path, MG_PYTHON=sys.executable)
    env[var] = value
    r, _ = _run(["--dry-run", str(tmp_path / "out")], env, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_pytest_plugin_keeps_the_tests_whose_skip_reason_names_cuda():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check_pytest import needs_cuda
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def item(*marks):
        return SimpleNamespace(iter_markers=lambda name: [m for m in marks if name == "skipif"])

    cuda = SimpleNamespace(args=(True,), kwargs={"reason": "needs CUDA (run benchmarks/gpu_check.sh)"})
    other = SimpleNamespace(args=(True,), kwargs={"reason": "needs a C++ compiler"})
    assert needs_cuda(item(cuda)) and needs_cuda(item(other, cuda))
    assert not needs_cuda(item(other)) and not needs_cuda(item())


def _phases():
    """benchmarks/gpu_check_phases.py as a module, with benchmarks/ on sys.path (its phases import their
    neighbours: codec.py, codec_kernels.py)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check_phases

    return gpu_check_phases


def test_cuda_tests_without_pytest_are_skipped_with_the_reason(tmp_path):
    """A device Python without pytest: the phase says so in the JSON and is skipped, not failed."""
    shadow = tmp_path / "no_pytest"
    shadow.mkdir()
    (shadow / "pytest.py").write_text("raise ModuleNotFoundError(\"No module named 'pytest'\", name='pytest')\n")
    out = tmp_path / "out"
    env = _env(tmp_path, MG_PYTHON=sys.executable, GPU_CHECK_ONLY="cuda_tests", PYTHONPATH=str(shadow))
    r, _ = _run(["--dry-run", str(out)], env, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    d, members = _outputs(out)
    t = d["cuda_tests"]
    assert t["status"] == "skipped" and t["pytest_available"] is False, t
    assert t["reason"].startswith("pytest is not installed for ") and "pip install pytest" in t["reason"]
    assert "phase_skipped" not in t and "gpu_check_logs/cuda_tests.log" in members
    assert d["failed"] == [] and d["finished"] is True
    assert "cuda_tests: skipped" in r.stdout and "all phases passed (skipped: " in r.stdout


def test_codec_dp_check_counts_the_values_a_reciprocal_multiply_changes(monkeypatch):
    """The DP check against its FP64-based reference: exact for the codecs' own mean; a mean that multiplies by
    1 / dp (what a division by a constant becomes on a GPU) differs at DP 3, not at DP 2 (0.5 is exact)."""
    P = _phases()
    from megatron_geo.comm import wire_fp8

    rows = P.DP_CHECK_CODECS[:1]
    found = P.codec_dp_check("cpu", False, (2, 3, 64), rows, numel=1 << 14)
    assert found == {rows[0][0]: {f"dp{n}": {"eager_differing_from_reference": 0} for n in (2, 3, 64)}}

    def reciprocal_mean(vals, divisor, out):
        return out.copy_(vals.sum(0) * (1.0 / divisor))

    monkeypatch.setattr(wire_fp8, "mean_over_sources", reciprocal_mean)
    bad = P.codec_dp_check("cpu", False, (2, 3), rows, numel=1 << 14)[rows[0][0]]
    assert bad["dp2"]["eager_differing_from_reference"] == 0
    assert 1000 < bad["dp3"]["eager_differing_from_reference"] < 16384 - 1000, bad


def test_codec_phase_compiled_on_the_cpu_reports_every_preset_and_the_dp_check(tmp_path, monkeypatch):
    """The codec phase with the compiled codecs (a GPU run's path, here on the CPU backend with two presets and
    DP 2 and 3): the background compiles finish, every preset has its eager and compiled row (compiled = eager
    bitwise), and the DP check counts no differing value."""
    P = _phases()
    import torch.distributed as dist
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if dist.is_initialized():  # the phase makes its own (fake) default group, as on a device; an earlier test module's
        dist.destroy_process_group()  # one-rank group (the `world` fixture) would make that a second one
    # the phase's processes compile for the host's widest vector unit into their own Inductor cache (an environment
    # pinned to AVX2 would have Inductor's AVX2 code built with -march=native on an AVX-512 host, which miscompiles
    # int32 selects)
    widest = max([isa.bit_width() for isa in valid_vec_isa_list()], default=0)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", {512: "avx512", 256: "avx2"}.get(widest, "default"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    threads = torch.get_num_threads()
    try:
        rec = P.Record(str(tmp_path / "codec.json"))
        P.phase_codec(
            P.Ctx(True, str(tmp_path)), rec, ["fp8", "bf16"], True, (2, 3), [r for r in P.DP_CHECK_CODECS[:1]]
        )
    finally:
        torch.set_num_threads(threads)  # benchmarks/codec.py sets its own
    d = json.loads((tmp_path / "codec.json").read_text())
    assert d["checks"] and all(d["checks"].values()), d["checks"]
    rows = d["reducer"]["presets"]
    assert d["reducer"]["modes"] == "both" and set(rows) == {"fp8", "bf16"}
    for p in ("fp8", "bf16"):
        assert rows[p]["compiled"]["bitwise_equal_eager"] is True and rows[p]["compiled_run_s"] > 0, rows[p]
        assert rows[p]["compiled"]["time_over_copy"] > 0 and "ratio_to_memcpy" not in rows[p]["compiled"]
    want = {"eager_differing_from_reference": 0, "compiled_differing_from_eager": 0}
    assert d["decode_dp"]["codecs"] == {"fp8_e4m3 granule16": {"dp2": want, "dp3": want}}
    assert {n: j["exit_code"] for n, j in d["background"].items()} == {"fp8_e4m3 granule16": 0, "dp_check": 0}
