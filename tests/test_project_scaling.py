"""tools/project_scaling.py: collective and step times against hand-computed values, calibration, CLI."""

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("project_scaling", REPO / "tools" / "project_scaling.py")
ps = importlib.util.module_from_spec(_spec)
sys.modules["project_scaling"] = ps
_spec.loader.exec_module(ps)

CODEC = """codec round trip (quantize + dequantize), 4,194,304 FP32 elements (16 MiB), median of 5, cpu
operation               median ms      GB/s  ratio to copy
copy                        10.00      1.68          1.000
fp8_e4m3 tensor             40.00      0.42          0.250
nvfp4                       80.00      0.21          0.125
hadamard128 rot+inv         50.00      0.34          0.200
bf16 cast                   20.00      0.84          0.500
"""
GEO = "geofp8 (same + transform=geo)   mean step    101.0 ms   added +2.00% of the fp8 step (target <= 1%)\n"


def costs():
    return ps.Costs(ps.parse_codec_output(CODEC, "t"), ps.parse_geo_output(GEO, "g"), {})


# a model with round numbers: 1e9 parameters, 6 GFLOP/token, 1e6 tokens/step, no per-tensor scales
M = ps.Model("m", 10**9, 0, 6e9, 10**6)
C = ps.Cluster(
    gpus_per_node=1,
    net_gbs=50.0,
    intra_gbs=400.0,
    alpha_us=5.0,
    peak_tflops=1000.0,
    mfu=0.5,
    overlap=0.5,
    copy_gbs=2000.0,
)


def test_parse_benchmark_outputs():
    c = costs()
    assert c.ratio_to_copy["fp8_e4m3 tensor"] == 0.25 and c.ratio_to_copy["hadamard128 rot+inv"] == 0.2
    assert c.geo_overhead == pytest.approx(0.02)
    with pytest.raises(ps.ProjectionError, match="lacks rows"):
        ps.parse_codec_output("copy 1.0 1.0 1.000\n", "f.txt")
    with pytest.raises(ps.ProjectionError, match="no 'added"):
        ps.parse_geo_output("nothing", "g.txt")
    # the in-step figure at the default refresh interval wins over the noisier end-to-end difference
    own = GEO + (
        "  at geo.refresh_interval=10: transforms + (refresh + hooks) / 10 = 9.00 ms = +9.00% of the fp8 step\n"
        "  at geo.refresh_interval=50: transforms + (refresh + hooks) / 50 = 0.93 ms = +0.93% of the fp8 step\n"
    )
    assert ps.parse_geo_output(own, "g") == pytest.approx(0.0093)


def test_collective_times_by_hand():
    # n=4, 1 GB, 10 GB/s, 10 us: 3 * 1e-5 + 3/4 * 0.1 s per phase
    assert ps.ring_phase_time(4, 1e9, 1e10, 1e-5) == pytest.approx(0.07503, rel=1e-12)
    assert ps.allreduce_time(4, 1e9, 1e10, 1e-5) == pytest.approx(0.15006, rel=1e-12)
    assert ps.allreduce_time(1, 1e9, 1e10, 1e-5) == 0.0
    # docs/design.md section 6: 600M FP32 ring all-reduce over 64 GPUs at 50 GB/s, bandwidth term ~94 ms
    assert ps.allreduce_time(64, 600e6 * 4, 50e9, 0.0) == pytest.approx(0.0945, abs=5e-4)
    assert ps.bytes_per_element("nvfp4", 10**9, 0) == pytest.approx(0.5 + 1 / 16 + 4 / 1024)
    assert ps.bytes_per_element("fp8_ef", 1000, 10) == pytest.approx(1.04)


def test_step_breakdown_by_hand():
    c = costs()
    s = ps.step_breakdown("fp32", 8, M, C, c)
    # compute 6e15 FLOP / (8 * 1e15 * 0.5) = 1.5 s; all-reduce 2 (7 * 5e-6 + 7/8 * 4e9 / 50e9) = 0.14007 s
    assert s["compute"] == pytest.approx(1.5) and s["comm"] == pytest.approx(0.14007)
    assert s["exposed"] == pytest.approx(0.070035) and s["codec"] == 0.0 and s["step"] == pytest.approx(1.570035)
    s = ps.step_breakdown("fp8", 8, M, C, c)
    # 2 (3.5e-5 + 7/8 * 1e9 / 50e9) = 0.03507; codec 2 * (4e9 / 2e12) / 0.25 = 0.016
    assert s["comm"] == pytest.approx(0.03507) and s["codec"] == pytest.approx(0.016)
    assert s["step"] == pytest.approx(1.5 + 0.017535 + 0.016)
    g = ps.step_breakdown("geofp8", 8, M, C, c)  # fp8 + one EF copy pass (0.002 s), times 1.02
    assert g["step"] == pytest.approx((1.5 + 0.017535 + 0.016 + 0.002) * 1.02)
    h = ps.step_breakdown("fp8_hadamard", 8, M, C, c)
    assert h["codec"] == pytest.approx(0.016 + 2 * 0.002 / 0.2)
    # hiding is capped by the backward window (2/3 of compute)
    s = ps.step_breakdown("fp32", 8, M, replace(C, overlap=1.0, mfu=50.0), c)  # compute 0.015 s
    assert s["exposed"] == pytest.approx(0.14007 - 0.01)
    # inside one node the intra-node bandwidth is used
    s = ps.step_breakdown("fp32", 4, M, replace(C, gpus_per_node=4), c)
    assert s["comm"] == pytest.approx(2 * (3 * 5e-6 + 0.75 * 4e9 / 400e9))
    assert ps.reduction("fp8", "fp32", 8, M, C, c) == pytest.approx(1 - 1.533535 / 1.570035)


def test_calibration_reproduces_target():
    c = costs()
    m = ps.model_from_config(str(REPO / "configs" / "llama_600m.yaml"), 512)
    cal, what = ps.calibrate(m, replace(C, mfu=0.4), c, target=0.108, n=64)
    assert what == "overlap" and 0 <= cal.overlap <= 1
    assert ps.reduction("fp8", "fp32", 64, m, cal, c) == pytest.approx(0.108, abs=1e-9)
    # a target out of reach with overlap: the MFU is solved with no overlap instead
    cal, what = ps.calibrate(m, replace(C, mfu=0.05), c, target=0.108, n=64)
    assert what == "mfu" and cal.overlap == 0.0
    assert ps.reduction("fp8", "fp32", 64, m, cal, c) == pytest.approx(0.108, abs=1e-9)


def test_cli(tmp_path):
    (tmp_path / "codec.txt").write_text(CODEC)
    (tmp_path / "geo.txt").write_text(GEO)
    tool = [
        sys.executable,
        str(REPO / "tools" / "project_scaling.py"),
        "--codec-output",
        str(tmp_path / "codec.txt"),
        "--geo-output",
        str(tmp_path / "geo.txt"),
        "--gpus",
        "8",
        "64",
    ]
    res = subprocess.run(tool + ["--plot", str(tmp_path / "p.png")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "fp8 vs fp32 +10.8% (paper 10.8%)" in res.stdout and "| tools/" not in res.stdout
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    res = subprocess.run(tool[:2] + ["--codec-output", str(tmp_path / "none.txt")], capture_output=True, text=True)
    assert res.returncode == 2 and "none.txt' not found" in res.stderr


def _gpu_check_json(tmp_path, dry=False):
    import json

    ops = {
        k: {"ms": 1.0, "gbps": g, "ratio_to_copy": g / 2000.0}
        for k, g in (
            ("copy", 2000.0),
            ("fp8_e4m3 tensor", 1000.0),
            ("nvfp4", 500.0),
            ("hadamard128 rot+inv", 400.0),
            ("bf16 cast", 1600.0),
        )
    }
    d = {
        "dry_run": dry,
        "codec": {"ops": ops},
        "geo": {"layers": {"llama_600m.yaml": {"geo_added_ms_per_layer": 0.5}}},
        "train_600m": {"mfu": 0.35},
        "train_600m_compile": {"mfu": 0.5},
    }
    p = tmp_path / "gpu_check.json"
    p.write_text(json.dumps(d))
    return p


def test_gpu_check_figures_replace_the_cpu_ones(tmp_path):
    g = ps.load_gpu_check(str(_gpu_check_json(tmp_path)))
    assert g["copy_gbs"] == 2000.0 and g["ratio_to_copy"]["fp8_e4m3 tensor"] == 0.5
    assert g["geo_added_s_per_layer"] == {"llama_600m": 0.0005} and g["mfu"] == {"llama_600m": 0.35}
    m = ps.model_from_config(str(REPO / "configs" / "llama_600m.yaml"), 512)
    assert m.geo_layers == 20  # geo.layers default: every MLP down projection
    c = ps.Costs(g["ratio_to_copy"], 0.5, {}, g["geo_added_s_per_layer"])
    ef = ps.step_breakdown("fp8_ef", 64, m, C, c)["step"]
    assert ps.step_breakdown("geofp8", 64, m, C, c)["step"] == pytest.approx(ef + 20 * 0.0005)  # not x 1.5
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "project_scaling.py"),
            "--gpu-check",
            str(tmp_path / "gpu_check.json"),
            "--gpus",
            "64",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "MFU 0.350 |" in res.stdout and "device copy 2000 GB/s |" in res.stdout and "(GPU codec)" in res.stdout
    with pytest.raises(ps.ProjectionError, match="dry run"):
        ps.load_gpu_check(str(_gpu_check_json(tmp_path, dry=True)))


def test_codec_json_of_the_reducer_path(tmp_path):
    """``benchmarks/codec.py --json`` rows: compiled preferred, throughput = memcpy / ms, Hadamard = the
    fp8_hadamard preset minus fp8; a JSON without the needed presets names them."""
    import json

    row = lambda ms: {"ms": ms, "memcpy_ms": 2.0, "ratio_to_memcpy": ms / 2.0}  # noqa: E731
    d = {
        "presets": {"bf16": row(4.0), "fp8": row(40.0), "fp8_hadamard": row(60.0), "nvfp4": row(80.0)},
        "presets_compiled": {"bf16": row(4.0), "fp8": row(10.0), "fp8_hadamard": row(18.0), "nvfp4": row(16.0)},
    }
    r = ps.parse_codec_json(json.dumps(d), "c.json")
    assert r["fp8_e4m3 tensor"] == pytest.approx(0.2) and r["nvfp4"] == pytest.approx(0.125)
    assert r["hadamard128 rot+inv"] == pytest.approx(2.0 / 8.0) and r["bf16 cast"] == pytest.approx(0.5)
    del d["presets_compiled"]
    assert ps.parse_codec_json(json.dumps(d), "c.json")["fp8_e4m3 tensor"] == pytest.approx(0.05)
    with pytest.raises(ps.ProjectionError, match=r"lacks presets \['nvfp4'\]"):
        ps.parse_codec_json(json.dumps({"presets": {k: v for k, v in d["presets"].items() if k != "nvfp4"}}), "c")
    with pytest.raises(ps.ProjectionError, match="not the JSON"):
        ps.parse_codec_json("fp8 1 2 3", "c.json")


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--gpus", "0"], "--gpus 0 must be >= 1"),
        (["--mfu", "1.5"], "--mfu 1.5"),
        (["--plot", "/nonexistent_dir_x/p.png"], "does not exist"),
    ],
)
def test_bad_arguments_are_one_error_line(args, msg):
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "project_scaling.py"), *args], capture_output=True, text=True
    )
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr
