"""tools/project_scaling.py: collective, codec and step times against formulas written here, the bandwidth table,
gpu_check.json's override, the wire-byte ordering over the sensitivity grid, the baselines and the CLI."""

import importlib.util
import json
import math
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

# traced reduce-stage bytes per element (the shape of benchmarks/codec.py's fused figure), round numbers
TRAFFIC = {"fp32": 10.0, "bf16": 16.0, "fp8": 15.0, "fp8_ef": 31.0, "fp8_hadamard": 30.0, "nvfp4": 17.0}
GEO = "geofp8 (same + transform=geo)   mean step    101.0 ms   added +2.00% of the fp8 step (target <= 1%)\n"
# datasheet memory bandwidths, bytes/s (NVIDIA H100 SXM5, H200 SXM, GH200 96 GB HBM3 datasheets)
DATASHEET = {"h100": 3.35e12, "h200": 4.8e12, "gh200": 4.0e12}


def costs(**kw):
    return ps.Costs(dict(TRAFFIC), 0.02, {}, **kw)


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
    mem_gbs=4000.0,
)
WIRE = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "nccl_fp8_sum": 1.0, "nvfp4": 0.5 + 1 / 16 + 4 / 1024}


def test_parse_benchmark_outputs():
    assert ps.parse_geo_output(GEO, "g") == pytest.approx(0.02)
    with pytest.raises(ps.ProjectionError, match="no 'added"):
        ps.parse_geo_output("nothing", "g.txt")
    own = GEO + (
        "  at geo.refresh_interval=10: transforms + (refresh + hooks) / 10 = 9.00 ms = +9.00% of the fp8 step\n"
        "  at geo.refresh_interval=50: transforms + (refresh + hooks) / 50 = 0.93 ms = +0.93% of the fp8 step\n"
    )
    assert ps.parse_geo_output(own, "g") == pytest.approx(0.0093)


def test_codec_json_traffic():
    """The eager rows' fused bytes per element are read (compiled rows carry none); missing presets are named."""
    rows = {p: {"ms": 1.0, "memcpy_ms": 1.0, "fused_traffic_bytes_per_element": v} for p, v in TRAFFIC.items()}
    d = {"presets": rows, "presets_eager": rows, "presets_compiled": {p: {"ms": 0.5} for p in TRAFFIC}}
    assert ps.parse_codec_json(json.dumps(d), "c.json") == TRAFFIC
    del d["presets_eager"]["nvfp4"]
    with pytest.raises(ps.ProjectionError, match=r"presets \['nvfp4'\]"):
        ps.parse_codec_json(json.dumps({"presets_eager": d["presets_eager"]}), "c.json")
    with pytest.raises(ps.ProjectionError, match="not the JSON"):
        ps.parse_codec_json("fp8 1 2 3", "c.json")
    # the committed run carries the figure for every preset the projection needs
    committed = ps.parse_codec_json((REPO / "docs" / "bench" / "codec_cpu.json").read_text(), "codec_cpu.json")
    assert all(committed[p] > 8.0 for p in ps.NEEDED_PRESETS)  # at least a copy's read + write


def test_collective_times_by_hand():
    # n=4, 1 GB, 10 GB/s, 10 us: 3 * 1e-5 + 3/4 * 0.1 s per phase
    assert ps.ring_phase_time(4, 1e9, 1e10, 1e-5) == pytest.approx(0.07503, rel=1e-12)
    assert ps.allreduce_time(4, 1e9, 1e10, 1e-5) == pytest.approx(0.15006, rel=1e-12)
    assert ps.allreduce_time(1, 1e9, 1e10, 1e-5) == 0.0
    # docs/design.md section 6: 600M FP32 ring all-reduce over 64 GPUs at 50 GB/s, bandwidth term ~94 ms
    assert ps.allreduce_time(64, 600e6 * 4, 50e9, 0.0) == pytest.approx(0.0945, abs=5e-4)
    # NCCL FP8 sum: ring up to 8 ranks, tree above: 2 (ceil(log2 n) alpha + bytes / bw)
    assert ps.nccl_fp8_algorithm(8) == "ring" and ps.nccl_fp8_algorithm(9) == "tree"
    assert ps.nccl_fp8_allreduce_time(8, 1e9, 1e10, 1e-5) == pytest.approx(2 * (7e-5 + 7 / 8 * 0.1))
    assert ps.nccl_fp8_allreduce_time(16, 1e9, 1e10, 1e-5) == pytest.approx(2 * (4e-5 + 0.1))
    assert ps.nccl_fp8_allreduce_time(17, 1e9, 1e10, 1e-5) == pytest.approx(2 * (5e-5 + 0.1))
    assert ps.bytes_per_element("nvfp4", 10**9, 0) == pytest.approx(0.5 + 1 / 16 + 4 / 1024)
    assert ps.bytes_per_element("fp8_ef", 1000, 10) == pytest.approx(1.04)
    with pytest.raises(ps.ProjectionError, match="unknown mode 'int4'"):
        ps.bytes_per_element("int4", 10, 1)


def _codec_by_hand(reduce_bytes: float, wire_b: float, n: int, numel: float, mem: float) -> float:
    """Reduce stage at the bandwidth + gather stage: encode of the 1/n shard and decode of all, (4 + b) each."""
    return reduce_bytes * numel / mem + (4 + wire_b) * (1 + 1 / n) * numel / mem


@pytest.mark.parametrize("device", sorted(DATASHEET))
def test_codec_cost_from_the_bandwidth_table(device):
    c = replace(C, mem_gbs=ps.DEVICES[device]["mem_gbs"])
    mem = DATASHEET[device]
    k = costs()
    assert ps.codec_time("fp32", 8, M, c, k) == pytest.approx(10.0 * 1e9 / mem, rel=1e-12)
    for mode, traced in (("bf16", 16.0), ("fp8", 15.0), ("fp8_ef", 31.0), ("geofp8", 31.0), ("nvfp4", 17.0)):
        assert ps.codec_time(mode, 8, M, c, k) == pytest.approx(
            _codec_by_hand(traced, WIRE.get(mode, 1.0), 8, 1e9, mem), rel=1e-12
        ), mode
    # geonvfp4: nvfp4 plus error feedback's share (fp8_ef - fp8 = 16 bytes)
    assert ps.codec_time("geonvfp4", 8, M, c, k) == pytest.approx(
        _codec_by_hand(17.0 + 16.0, WIRE["nvfp4"], 8, 1e9, mem), rel=1e-12
    )
    # the NCCL FP8 sum: amax pass + scaled cast (9 bytes) before the collective
    assert ps.codec_time("nccl_fp8_sum", 8, M, c, k) == pytest.approx(_codec_by_hand(9.0, 1.0, 8, 1e9, mem))
    assert ps.codec_time("fp8", 1, M, c, k) == 0.0  # one GPU: nothing reduced


def test_step_breakdown_by_hand():
    k = costs()
    s = ps.step_breakdown("fp32", 8, M, C, k)
    # compute 6e15 FLOP / (8 * 1e15 * 0.5) = 1.5 s; all-reduce 2 (7 * 5e-6 + 7/8 * 4e9 / 50e9) = 0.14007 s
    assert s["compute"] == pytest.approx(1.5) and s["comm"] == pytest.approx(0.14007)
    assert s["exposed"] == pytest.approx(0.070035) and s["codec"] == pytest.approx(10e9 / 4e12)
    assert s["step"] == pytest.approx(1.5 + 0.070035 + 0.0025)
    s = ps.step_breakdown("fp8", 8, M, C, k)
    codec = (15 + 5 * 9 / 8) * 1e9 / 4e12
    assert s["comm"] == pytest.approx(0.03507) and s["codec"] == pytest.approx(codec)
    assert s["step"] == pytest.approx(1.5 + 0.017535 + codec)
    g = ps.step_breakdown("geofp8", 8, M, C, k)  # the fp8 + EF step times 1.02
    assert g["step"] == pytest.approx((1.5 + 0.017535 + (31 + 5 * 9 / 8) * 1e9 / 4e12) * 1.02)
    # the NCCL FP8 sum at 16 GPUs runs a tree: 2 (4 * 5e-6 + 1e9 / 50e9)
    s = ps.step_breakdown("nccl_fp8_sum", 16, M, C, k)
    assert s["comm"] == pytest.approx(0.04004) and s["compute"] == pytest.approx(0.75)
    # hiding is capped by the backward window (2/3 of compute)
    s = ps.step_breakdown("fp32", 8, M, replace(C, overlap=1.0, mfu=50.0), k)  # compute 0.015 s
    assert s["exposed"] == pytest.approx(0.14007 - 0.01)
    # inside one node the intra-node bandwidth is used
    s = ps.step_breakdown("fp32", 4, M, replace(C, gpus_per_node=4), k)
    assert s["comm"] == pytest.approx(2 * (3 * 5e-6 + 0.75 * 4e9 / 400e9))
    assert ps.step_breakdown("fp8", 8, M, C, k)["carried"] == pytest.approx(2.0)  # both stages, 1 byte each


def test_parameter_gather_layout_by_hand():
    """--gather params: the wire-format reduce-scatter, then every mode gathers FP32 parameters (4 bytes); no
    gather-stage codec; the NCCL FP8 sum's reduce-scatter runs PAT above 8 ranks."""
    k = costs()
    c = replace(C, gather="params", param_bytes=4.0)
    s = ps.step_breakdown("fp8", 8, M, c, k)
    rs, ag = 7 * 5e-6 + 7 / 8 * 1e9 / 50e9, 7 * 5e-6 + 7 / 8 * 4e9 / 50e9
    assert s["comm"] == pytest.approx(rs + ag) and s["codec"] == pytest.approx(15e9 / 4e12)
    assert s["exposed"] == pytest.approx(0.5 * (rs + ag)) and s["carried"] == pytest.approx(5.0)
    s = ps.step_breakdown("fp32", 8, M, c, k)
    assert s["comm"] == pytest.approx(2 * ag) and s["codec"] == pytest.approx(10e9 / 4e12)
    s = ps.step_breakdown("nccl_fp8_sum", 16, M, c, k)
    pat = 4 * 5e-6 + 15 / 16 * 1e9 / 50e9  # ceil(log2 16) hops, the ring's bandwidth term
    assert s["comm"] == pytest.approx(pat + 15 * 5e-6 + 15 / 16 * 4e9 / 50e9)
    assert s["codec"] == pytest.approx(9e9 / 4e12)
    s = ps.step_breakdown("nccl_fp8_sum", 8, M, c, k)  # ring at 8 ranks
    assert s["comm"] == pytest.approx(rs + ag)


def _gpu_check_json(tmp_path, dry=False, presets=("fp32", "bf16", "fp8", "fp8_ef", "fp8_hadamard")):
    """A small gpu_check.json in the layout benchmarks/gpu_check.py writes (phase name -> figures)."""
    ms = {"fp32": 0.5, "bf16": 0.8, "fp8": 1.0, "fp8_ef": 1.6, "fp8_hadamard": 1.5, "nvfp4": 1.2}
    d = {
        "dry_run": dry,
        "codec": {
            "status": "ok",
            "device_name": "NVIDIA H100 80GB HBM3",
            "ops": {"copy": {"ms": 1.0, "gbps": 1500.0, "ratio_to_copy": 1.0}},
            "reducer": {
                "numel": 2**20,
                "dp": 2,
                "presets": {
                    **{p: {"eager": {"ms": 9.0}, "compiled": {"ms": ms[p]}} for p in presets},
                    "fp8_block": {"skipped": "0 s left"},
                },
            },
        },
        "geo": {"layers": {"llama_600m.yaml": {"geo_added_ms_per_layer": 0.5}}},
        "train_600m": {"mfu": 0.35},
        "train_600m_compile": {"mfu": 0.5},
    }
    p = tmp_path / "gpu_check.json"
    p.write_text(json.dumps(d))
    return p, ms


def test_gpu_check_replaces_the_traffic_model(tmp_path):
    path, ms = _gpu_check_json(tmp_path)
    g = ps.load_gpu_check(str(path))
    assert g["mem_gbs"] == 3000.0  # a copy reads and writes: 2 x 1500
    assert g["gpu_s_per_element"]["fp8"] == pytest.approx(1.0e-3 / 2**20)  # compiled preferred over eager
    assert "fp8_block" not in g["gpu_s_per_element"] and "nvfp4" not in g["gpu_s_per_element"]
    assert g["geo_added_s_per_layer"] == {"llama_600m": 0.0005} and g["mfu"] == {"llama_600m": 0.35}
    k = costs(gpu_s_per_element=g["gpu_s_per_element"])
    c = replace(C, mem_gbs=g["mem_gbs"])
    # fp8: measured ms per 2^20 elements x 1e9 elements, plus the gather-stage formula at the measured bandwidth
    assert ps.codec_time("fp8", 8, M, c, k) == pytest.approx(1e-3 / 2**20 * 1e9 + 5 * 9 / 8 * 1e9 / 3e12)
    assert ps.codec_time("fp32", 8, M, c, k) == pytest.approx(0.5e-3 / 2**20 * 1e9)
    # nvfp4 has no GPU row here: its traced bytes at the measured bandwidth
    assert ps.codec_time("nvfp4", 8, M, c, k) == pytest.approx(_codec_by_hand(17.0, WIRE["nvfp4"], 8, 1e9, 3e12))
    m = ps.model_from_config(str(REPO / "configs" / "llama_600m.yaml"), 512)
    assert m.geo_layers == 20  # geo.layers default: every MLP down projection
    k.geo_added_s_per_layer = g["geo_added_s_per_layer"]
    ef = ps.step_breakdown("fp8_ef", 64, m, c, k)["step"]
    assert ps.step_breakdown("geofp8", 64, m, c, k)["step"] == pytest.approx(ef + 20 * 0.0005)
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "project_scaling.py"), "--gpu-check", str(path), "--gpus", "64"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "MFU 0.350 | measured:" in res.stdout and "device memory bandwidth 3000 GB/s | measured:" in res.stdout
    assert "ps/element (measured:" in res.stdout and "GPU codec rows missing for ['nvfp4']" in res.stdout
    with pytest.raises(ps.ProjectionError, match="dry run"):
        ps.load_gpu_check(str(_gpu_check_json(tmp_path, dry=True)[0]))


GRID = [(net, mfu, ov) for net in (25.0, 50.0, 100.0) for mfu in (0.3, 0.4, 0.5) for ov in (0.0, 0.4, 0.8)]


@pytest.mark.parametrize("config", ["llama_300m", "llama_600m"])
def test_fewer_wire_bytes_never_project_slower(config):
    """Over the whole sensitivity grid, every device and both collective layouts: a format with fewer wire bytes
    per element (byte sizes written here) and a memory-bound codec is never slower, at 4-256 GPUs on an even plan
    and at 4-128 GPUs with the config's shard plan. Not covered: 2 GPUs (see
    test_two_gpus_the_bf16_decode_can_cost_more_than_it_saves) and 256 GPUs with the configs' plans, whose
    all-to-all receives 2.6x the even bytes (the plan's imbalance, not the format: with --gather params BF16 then
    carries more bytes than FP32)."""
    assert sorted(GRID) == sorted(
        (net, mfu, ov) for net in ps.SENS_NET_GBS for mfu in ps.SENS_MFU for ov in ps.SENS_OVERLAP
    )
    planned = ps.model_from_config(str(REPO / "configs" / f"{config}.yaml"), 512)
    even = replace(planned, config_path="")  # wire ratio 1: no padding, balanced
    traffic = ps.parse_codec_json((REPO / "docs" / "bench" / "codec_cpu.json").read_text(), "codec_cpu.json")
    k = ps.Costs(traffic, 0.0, {})
    chains = (("fp32", "bf16", "fp8", "nvfp4"), ("fp32", "bf16", "nccl_fp8_sum"))
    checked = 0
    for dev in DATASHEET.values():
        for net, mfu, ov in GRID:
            for gather, m, gpus in (
                ("wire", even, (4, 8, 16, 64, 128, 256)),
                ("params", even, (4, 16, 256)),
                ("wire", planned, (4, 8, 16, 64, 128)),
                ("params", planned, (16, 128)),
            ):
                c = replace(ps.Cluster(), net_gbs=net, mfu=mfu, overlap=ov, mem_gbs=dev / 1e9, gather=gather)
                for n in gpus:
                    for chain in chains:
                        t = [ps.step_breakdown(x, n, m, c, k)["step"] for x in chain]
                        scale = 4 * m.n_tensors / m.params
                        b = [WIRE[x] + (scale if x in ("fp8", "nccl_fp8_sum") else 0) for x in chain]
                        assert b == sorted(b, reverse=True)
                        for i in range(len(chain) - 1):
                            assert t[i + 1] <= t[i], (config, dev, net, mfu, ov, n, chain[i + 1], chain[i])
                            checked += 1
                    assert ps.ordering_violations(n, m, c, k) == []
    assert checked == 3 * 27 * 16 * 5


def test_sensitivity_grid_and_baselines():
    m = ps.model_from_config(str(REPO / "configs" / "llama_600m.yaml"), 512)
    k = costs()
    grid = ps.sensitivity(m, 64, ps.Cluster(), k)
    assert len(grid) == 27 and {(x["net_gbs"], x["mfu"], x["overlap"]) for x in grid} == set(GRID)
    for x in grid:
        c = replace(ps.Cluster(), net_gbs=x["net_gbs"], mfu=x["mfu"], overlap=x["overlap"])
        steps = {b: ps.step_breakdown(b, 64, m, c, k)["step"] for b in ("fp32", "bf16", "nccl_fp8_sum")}
        assert x["baseline"] == min(steps, key=steps.get)
        assert x["geofp8_vs_baseline"] == pytest.approx(
            1 - ps.step_breakdown("geofp8", 64, m, c, k)["step"] / steps[x["baseline"]]
        )
    # more overlap never makes the FP32 step longer, more network bandwidth never does either
    for net, mfu, _ in GRID:
        t = [
            ps.step_breakdown("fp32", 64, m, replace(ps.Cluster(), net_gbs=net, mfu=mfu, overlap=o), k)["step"]
            for o in (0.0, 0.4, 0.8)
        ]
        assert t == sorted(t, reverse=True)


def test_cli(tmp_path):
    (tmp_path / "geo.txt").write_text(GEO)
    tool = [sys.executable, str(REPO / "tools" / "project_scaling.py"), "--geo-output", str(tmp_path / "geo.txt")]
    res = subprocess.run(
        tool + ["--gpus", "8", "64", "--device", "h100", "--plot", str(tmp_path / "p.png")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "device memory bandwidth 3350 GB/s | assumption: H100" in out and "| tools/" not in out
    assert "verdict llama_600m: per GPU count, the strongest baseline" in out
    assert "no mode carrying fewer bytes projects slower" in out and "collective: gradient all-reduce" in out
    assert out.count("*+") + out.count("*-") == 1  # the paper's cell marked once
    assert "FP8 vs FP32 10.8% and GeoFP8 vs FP32 7.6%" in out and "calibrat" not in out
    assert "--ddp-reduce-scatter-with-fp32-accumulation" in out and "our bf16 preset does the same" in out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    res = subprocess.run(tool + ["--codec-output", str(tmp_path / "none.json")], capture_output=True, text=True)
    assert res.returncode == 2 and "none.json' not found" in res.stderr


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--gpus", "0"], "--gpus 0 must be >= 1"),
        (["--mfu", "1.5"], "--mfu 1.5"),
        (["--overlap", "1.5"], "--overlap 1.5 must be in [0, 1]"),
        (["--mem-gbs", "0"], "--mem-gbs 0.0 must be > 0"),
        (["--plot", "/nonexistent_dir_x/p.png"], "does not exist"),
    ],
)
def test_bad_arguments_are_one_error_line(args, msg):
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "project_scaling.py"), *args], capture_output=True, text=True
    )
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr


def test_log2_tree_depth_is_a_ceiling():
    for n in (9, 16, 33, 256):
        assert ps.nccl_fp8_allreduce_time(n, 0.0, 1.0, 1.0) == 2 * math.ceil(math.log2(n))


def test_two_gpus_the_bf16_decode_can_cost_more_than_it_saves():
    """The ordering's boundary, by hand: at 2 GPUs a ring moves half the buffer, and with 80% of it hidden the
    BF16 bytes saved (0.2 x 2 x 0.5 x (4e9 - 2e9) / 100e9 s of exposed ring time) are fewer than the extra codec
    passes cost on an H100 ((16 + 6 x 1.5 - 10) bytes x 1e9 / 3.35e12 B/s)."""
    c = replace(C, net_gbs=100.0, overlap=0.8, mem_gbs=3350.0, mfu=0.01)  # long compute: the window never caps
    saved = 0.2 * 2 * 0.5 * (4e9 - 2e9) / 100e9  # the latency terms are the same for both
    extra = (16 + 6 * 1.5 - 10) * 1e9 / 3.35e12
    t32, t16 = (ps.step_breakdown(x, 2, M, c, costs())["step"] for x in ("fp32", "bf16"))
    assert t16 - t32 == pytest.approx(extra - saved, rel=1e-9) and t16 > t32
    assert ps.ordering_violations(2, M, c, costs()) and not ps.ordering_violations(4, M, c, costs())
