"""tools/project_scaling.py: the overlap windows against chains computed by hand, one step's breakdown by hand, the
byte counts against the wire-format registry, a faster fabric never projecting a longer step, the check against
the no-bucket arithmetic, gpu_check.json's figures and the CLI."""

import importlib.util
import json
import random
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
TRAFFIC = {"fp32": 10.0, "bf16": 16.0, "fp8": 15.0, "fp8_ef": 31.0, "nvfp4": 17.0}
GEO = "geofp8 (same + transform=geo)   mean step    101.0 ms   added +2.00% of the fp8 step (target <= 1%)\n"


def costs(**kw):
    return ps.Costs(dict(TRAFFIC), 0.02, {}, **kw)


def rows_by_name(params=("bf16", "fp8")):
    return {f"{s.name}/{s.params}": s for s in ps.schemes(list(params))}


# -- the windows -------------------------------------------------------------------------------------------------------
def test_gradient_window_of_three_buckets_by_hand():
    """Backward parts 2, 3, 5 s, collectives 4, 1, 1 s: bucket 0 ready at 2, sent 2-6; bucket 1 ready at 5, waits for
    the link, 6-7; bucket 2 ready at 10 (the end of the backward), 10-11: 1 s exposed. The no-bucket estimate,
    6 s of collectives in a 10 s window, says 0."""
    assert ps.grad_exposed([2.0, 3.0, 5.0], [4.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert ps.lump_exposed(6.0, 10.0) == 0.0
    # a long first collective holds the chain: 2-12, 12-13, 13-14: 4 s past the backward's end at 10
    assert ps.grad_exposed([2.0, 3.0, 5.0], [10.0, 1.0, 1.0]) == pytest.approx(4.0)
    # the last bucket's collective always starts at the end of the backward: never less than it
    assert ps.grad_exposed([1.0, 1.0], [0.0, 0.5]) == pytest.approx(0.5)


def test_parameter_window_of_three_buckets_by_hand():
    """Forward order, forward parts 1, 4, 5 s, gathers 3, 1, 2 s, all started at 0: gathered at 3, 4, 6; forward 0
    runs 3-4, forward 1 4-8, forward 2 8-13 (gather 2 was done at 6): 3 s more than the 10 s forward."""
    assert ps.param_exposed([1.0, 4.0, 5.0], [3.0, 1.0, 2.0]) == pytest.approx(3.0)
    # the embedding's bucket first (no forward FLOPs): the next forward waits for both gathers (4 s); the third gather
    # (done at 6) hides behind the 5 s forward part that runs 4-9
    assert ps.param_exposed([0.0, 5.0, 5.0], [2.0, 2.0, 2.0]) == pytest.approx(4.0)
    # gathers slower than the forward: the chain sets the end (6 s of gathers, then the last 1 s forward part)
    assert ps.param_exposed([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) == pytest.approx(7.0 - 3.0)


def test_per_bucket_exposure_is_never_below_the_no_bucket_estimate_and_grows_with_the_collectives():
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 6)
        comp = [rng.uniform(0, 3) for _ in range(k)]
        comm = [rng.uniform(0, 3) for _ in range(k)]
        g, p = ps.grad_exposed(comp, comm), ps.param_exposed(comp, comm)
        assert g >= ps.lump_exposed(sum(comm), sum(comp)) - 1e-12 and g >= 0
        assert p >= ps.lump_exposed(sum(comm), sum(comp)) - 1e-12 and p >= 0
        slower = [c * rng.uniform(1, 2) for c in comm]  # every collective as long or longer: never less exposed
        assert ps.grad_exposed(comp, slower) >= g - 1e-12 and ps.param_exposed(comp, slower) >= p - 1e-12


# -- one step by hand --------------------------------------------------------------------------------------------------
# three buckets of 1e9 elements, FLOP shares 1/2, 1/4, 1/4 in launch order; 8 samples of 1000 tokens, micro batch 2
M = ps.Model(
    "m", 3 * 10**9, 1.2e10, ps.Batch(8, 1000, 2), [(("a",), 10**9, 2.0), (("b",), 10**9, 1.0), (("c",), 10**9, 1.0)]
)
C = ps.Cluster(peak_tflops=1000.0, mfu=0.5, mem_gbs=1000.0, efficiency=1.0)
LINK = ps.Fabric("test", 100.0, 10.0, "a 100 GB/s test link, 10 us per step")


def test_step_of_three_buckets_by_hand():
    """DP 4: 2 samples per rank, one micro-batch; compute 1.2e10 x 2000 / (1e15 x 0.5) = 48 ms, forward 16, backward
    32; per bucket backward 16, 8, 8 ms, forward (forward order) 4, 4, 8 ms. 4 ranks: NCCL's ring, 3 steps."""
    r = rows_by_name()
    s = ps.step_breakdown(r["fp32_rs/bf16"], 4, M, LINK, C, costs())
    assert s["compute"] == pytest.approx(0.048) and s["micro_batches"] == 1
    assert s["last_backward"] == pytest.approx(0.032) and s["first_forward"] == pytest.approx(0.016)
    rs = 3e-5 + 0.75e9 * 4 / 1e11  # 30.03 ms per bucket
    ends = [0.016 + rs]  # ready at 16, 24, 32 ms
    ends.append(max(0.024, ends[-1]) + rs)
    ends.append(max(0.032, ends[-1]) + rs)
    assert s["reduce_scatter"] == pytest.approx(3 * rs) and s["exposed_rs"] == pytest.approx(ends[-1] - 0.032)
    ag = 3e-5 + 0.75e9 * 2 / 1e11  # BF16 parameters, 15.03 ms per bucket, gathered at 1, 2, 3 x ag
    done = max(0.0, ag) + 0.004
    done = max(done, 2 * ag) + 0.004
    done = max(done, 3 * ag) + 0.008
    assert s["exposed_ag"] == pytest.approx(done - 0.016) and s["codec"] == 0.0
    assert s["step"] == pytest.approx(0.048 + (ends[-1] - 0.032) + (done - 0.016))

    f = ps.step_breakdown(r["fp8/fp8"], 4, M, LINK, C, costs())
    a2a = 3e-5 + max(0.75e9, 3 * 0.25e9) * 1.0 / 1e11  # balanced all-to-all of 1-byte codes: 7.53 ms
    assert f["exposed_rs"] == pytest.approx(a2a)  # buckets 0 and 1 hide; bucket 2 starts at the end of the backward
    g = 3e-5 + 0.75e9 * (1 + 4 / 128) / 1e11  # FP8 parameters with one FP32 scale per 128: 1.03125 bytes
    done = g + 0.004
    done = max(done, 2 * g) + 0.004
    done = max(done, 3 * g) + 0.008
    assert f["exposed_ag"] == pytest.approx(done - 0.016)
    b = 1 + 4 / 128  # the parameter codec: decode every element (b + 4), encode 1/4 of them (b + 6)
    assert f["codec"] == pytest.approx((15.0 + (b + 4) + (b + 6) / 4) * 3e9 / 1e12)
    assert f["step"] == pytest.approx(0.048 + a2a + (done - 0.016) + f["codec"])


def test_collective_times_by_hand():
    b = ps.Bucket(1e9, 0.25e9, 0.25e9, 1.0)
    link = (1e10, 1e-5)
    assert ps.collective_time("nccl", 4, b, 4.0, link) == pytest.approx(3e-5 + 0.3)  # ring up to 8 ranks
    e = ps.Bucket(1e9, 1e9 / 64, 1e9 / 64, 1.0)
    assert ps.collective_time("nccl", 64, e, 4.0, link) == pytest.approx(6e-5 + 63 / 64 * 0.4)  # PAT: log2 64 steps
    assert ps.collective_time("ring", 64, e, 4.0, link) == pytest.approx(63e-5 + 63 / 64 * 0.4)
    # an uneven bucket: the owner of 0.5e9 of 1e9 elements receives 3 x 0.5e9 in the all-to-all, the others own less
    u = ps.Bucket(1e9, 0.5e9, 0.0, 1.0)
    assert ps.collective_time("all_to_all", 4, u, 1.0, link) == pytest.approx(3e-5 + 1.5e9 / 1e10)
    assert ps.collective_time("ring", 4, u, 1.0, link) == pytest.approx(3e-5 + 1e9 / 1e10)
    assert ps.collective_time("all_to_all", 1, u, 1.0, link) == 0.0
    with pytest.raises(ps.ProjectionError, match="unknown collective 'tree'"):
        ps.collective_time("tree", 4, b, 1.0, link)


# -- the registry's bytes ----------------------------------------------------------------------------------------------
def test_bytes_per_element_are_the_registrys():
    from megatron_geo.comm.formats import comm_view, get_format
    from megatron_geo.config.presets import preset_config

    for mode, preset in ps.GRAD_MODES.items():
        comm = preset_config(preset).comm
        assert ps.grad_bytes_per_element(preset) == get_format(comm.dtype).bytes_per_element(comm), mode
    assert ps.param_bytes_per_element("bf16") == 2.0 and ps.param_bytes_per_element("fp32") == 4.0
    fp8 = comm_view(dtype="fp8_e4m3", scaling="block")
    assert ps.param_bytes_per_element("fp8") == get_format("fp8_e4m3").bytes_per_element(fp8) == 1 + 4 / 128
    assert ps.param_bytes_per_element("nvfp4") == get_format("nvfp4").bytes_per_element(comm_view(dtype="nvfp4"))
    with pytest.raises(ps.ProjectionError, match="unknown parameter-gather format 'int4'"):
        ps.param_bytes_per_element("int4")
    rows = ps.schemes(["bf16", "fp8", "nvfp4"])
    preset = {**ps.GRAD_MODES, "fp32_rs": "fp32", "bf16_a2a": "bf16", "bf16_sym": "bf16", "nccl_fp8": "fp8"}
    for s in rows:  # every row's bytes come from there; no table of the tool's own
        assert s.grad_bytes == ps.grad_bytes_per_element(preset[s.name]), s.name
        assert s.param_bytes == ps.param_bytes_per_element(s.params)
    assert not hasattr(ps, "bytes_per_element")
    assert len(rows) == 4 + 5 * 3 and {s.name for s in rows if not s.planned} == set(ps.BASELINES)


def test_parameter_flops_add_up_to_flops_per_token():
    m = ps.model_from_config(str(REPO / "configs" / "llama_600m.yaml"))
    assert sum(m.param_flops.values()) == pytest.approx(m.flops_per_token, rel=1e-12)
    assert m.param_flops["embed.weight"] == 0.0 and m.param_flops["norm.weight"] == 0.0
    for n in (64, 256):
        ev = ps.even_buckets(m, n)
        assert sum(b.flops_share for b in ev) == pytest.approx(1.0) and sum(b.numel for b in ev) == m.params
        assert ev[-1].flops_share == 0.0 or ev[0].flops_share > 0  # the embedding's bucket comes last in backward
        pl = ps.plan_buckets(m, n, "fp8")
        assert len(pl) == len(ev) and sum(b.numel for b in pl) >= m.params
        assert sum(b.flops_share for b in pl) == pytest.approx(1.0)


# -- fabrics -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["even", "plan"])
def test_a_faster_fabric_never_projects_a_longer_step(layout):
    models = [ps.model_from_config(str(REPO / "configs" / f"{n}.yaml")) for n in ("llama_300m", "llama_600m")]
    fabrics = list(ps.FABRICS.values())
    c = replace(ps.Cluster(), layout=layout)
    out = ps.projection_table(models, [64, 256], fabrics, c, costs(), ps.schemes(["bf16", "fp8", "nvfp4"]))
    assert ps.monotonic_violations(out, fabrics, c.efficiency) == []
    order = sorted(fabrics, key=lambda f: f.gbs(c.efficiency))
    assert [f.name for f in order] == ["ndr200", "ndr400", "nvlink"]
    by = {(r["model"], r["gpus"], r["row"], r["fabric"]): r for r in out}
    for mname, n, row, fab in by:
        if fab == "nvlink":
            steps = [by[(mname, n, row, f)]["step"] for f in ("ndr200", "ndr400", "nvlink")]
            assert steps == sorted(steps, reverse=True), (mname, n, row)
    # a slower fabric the check must catch
    slow = ps.Fabric("slow", 1.0, 10.0, "")
    fake = [dict(r, fabric="slow", step=r["step"] / 2) for r in out if r["fabric"] == "ndr200"]
    assert ps.monotonic_violations(out + fake, fabrics + [slow], c.efficiency)


def test_fabric_figures_are_stated():
    assert ps.FABRICS["nvlink"].gbs(0.9) == pytest.approx(405.0)
    assert ps.FABRICS["ndr400"].gbs(0.9) == pytest.approx(45.0)
    assert ps.FABRICS["ndr200"].gbs(0.9) == pytest.approx(22.5)
    assert "one GPU per node" in ps.FABRICS["nvlink"].what


# -- the no-bucket arithmetic ------------------------------------------------------------------------------------------
def test_llama_600m_at_dp_64_on_22_5_gbs_matches_the_no_bucket_arithmetic():
    """FP32 reduce-scatter of 617.4M parameters over 64 ranks at 22.5 GB/s: 63/64 x 2.47 GB / 22.5 GB/s = 108 ms; the
    BF16 gather half that. Counting 6 x every parameter + 12 L s h (compute 185 ms, windows 61.6 and 30.8 ms) the
    no-bucket arithmetic leaves ~47 ms and ~24 ms exposed of a ~255 ms step, FP8 gradients save ~18% and FP8
    parameters as well ~28%. Megatron-LM's count (no embedding) gives 172.5 ms of compute, shorter windows, more
    exposed; the per-bucket chains expose a few ms more than the no-bucket estimate."""
    m = ps.model_from_config(str(REPO / "configs" / "llama_600m.yaml"))
    chk = ps.no_bucket_check(m, ps.FABRICS["ndr200"], ps.Cluster(), costs())
    ref = chk["fp32_rs"]
    assert ref["reduce_scatter"] == pytest.approx(63 / 64 * m.params * 4 / 22.5e9, abs=0.5e-3)
    assert ref["all_gather"] == pytest.approx(63 / 64 * m.params * 2 / 22.5e9, abs=0.5e-3)
    assert ref["compute"] == pytest.approx(0.1725, abs=1e-4)
    alt = ref["all_params"]
    assert alt["compute"] == pytest.approx(0.1847, abs=1e-4)
    assert alt["lump_rs"] == pytest.approx(0.0469, abs=1e-3) and alt["lump_ag"] == pytest.approx(0.0236, abs=1e-3)
    assert alt["lump_step"] == pytest.approx(0.255, abs=2e-3)
    assert chk["fp8 / bf16"]["all_params"]["lump_vs_fp32_rs"] == pytest.approx(0.18, abs=0.01)
    assert chk["fp8 / fp8"]["all_params"]["lump_vs_fp32_rs"] == pytest.approx(0.276, abs=0.01)
    for v in chk.values():
        assert v["exposed_rs"] >= v["lump_rs"] and v["exposed_ag"] >= v["lump_ag"]
    # on NDR400 both collectives about fill their windows: within 1.5 ms of them without buckets
    n4 = ps.no_bucket_check(m, ps.FABRICS["ndr400"], ps.Cluster(), costs())["fp32_rs"]["all_params"]
    assert n4["lump_rs"] < 1.5e-3 and n4["lump_ag"] < 1.5e-3


def test_the_shard_plan_makes_the_owner_of_a_whole_matrix_receive_every_copy():
    """--layout plan: at DP 64 a bucket holding a 4096 x 1536 Muon matrix owned whole has its owner receive 63 copies
    of it through the all-to-all, while the baselines split evenly."""
    m = ps.model_from_config(str(REPO / "configs" / "llama_600m.yaml"))
    pl = ps.plan_buckets(m, 64, "fp8")
    assert max(b.own_max for b in pl) == 4096 * 1536
    r = rows_by_name()
    f = ps.FABRICS["ndr200"]
    even = ps.step_breakdown(r["fp8/bf16"], 64, m, f, ps.Cluster(), costs())
    plan = ps.step_breakdown(r["fp8/bf16"], 64, m, f, replace(ps.Cluster(), layout="plan"), costs())
    link = (f.gbs(0.9) * 1e9, f.alpha_us * 1e-6)
    assert plan["reduce_scatter"] == pytest.approx(sum(ps.collective_time("all_to_all", 64, b, 1.0, link) for b in pl))
    assert plan["reduce_scatter"] > 4 * even["reduce_scatter"]
    base = ps.step_breakdown(r["fp32_rs/bf16"], 64, m, f, replace(ps.Cluster(), layout="plan"), costs())
    assert base == ps.step_breakdown(r["fp32_rs/bf16"], 64, m, f, ps.Cluster(), costs())  # baselines: even always


# -- measured inputs ---------------------------------------------------------------------------------------------------
def test_parse_benchmark_outputs():
    assert ps.parse_geo_output(GEO, "g") == pytest.approx(0.02)
    with pytest.raises(ps.ProjectionError, match="no 'added"):
        ps.parse_geo_output("nothing", "g.txt")
    rows = {p: {"ms": 1.0, "memcpy_ms": 1.0, "fused_traffic_bytes_per_element": v} for p, v in TRAFFIC.items()}
    d = {"presets": rows, "presets_eager": rows}
    assert ps.parse_codec_json(json.dumps(d), "c.json") == TRAFFIC
    del d["presets_eager"]["nvfp4"]
    with pytest.raises(ps.ProjectionError, match=r"presets \['nvfp4'\]"):
        ps.parse_codec_json(json.dumps({"presets_eager": d["presets_eager"]}), "c.json")
    committed = ps.parse_codec_json((REPO / "docs" / "bench" / "codec_cpu.json").read_text(), "codec_cpu.json")
    assert all(committed[p] > 8.0 for p in ps.NEEDED_PRESETS)  # at least a copy's read + write


def _gpu_check_json(tmp_path, dry=False):
    """A small gpu_check.json in the layout benchmarks/gpu_check.py writes (phase name -> figures)."""
    ms = {"fp32": 0.5, "bf16": 0.8, "fp8": 1.0, "fp8_ef": 1.6}
    d = {
        "dry_run": dry,
        "codec": {
            "status": "ok",
            "device_name": "NVIDIA H100 80GB HBM3",
            "ops": {"copy": {"ms": 1.0, "gbps": 1500.0, "time_over_copy": 1.0}},
            "reducer": {
                "numel": 2**20,
                "presets": {
                    **{p: {"eager": {"ms": 9.0}, "compiled": {"ms": v}} for p, v in ms.items()},
                    "fp8_block": {"eager": {"ms": 9.0}, "compiled_skipped": "0 s left"},
                },
            },
        },
        "geo": {"layers": {"llama_600m.yaml": {"geo_added_ms_per_layer": 0.5}}},
        "train_600m": {"mfu": 0.30, "dp64_equivalent": {"mfu": 0.35}},
        "train_600m_compile": {"mfu": 0.5},
    }
    p = tmp_path / "gpu_check.json"
    p.write_text(json.dumps(d))
    return p


def test_gpu_check_replaces_the_traffic_model_and_the_mfu(tmp_path):
    path = _gpu_check_json(tmp_path)
    g = ps.load_gpu_check(str(path))
    assert g["mem_gbs"] == 3000.0  # a copy reads and writes: 2 x 1500
    assert g["gpu_s_per_element"]["fp8"] == pytest.approx(1.0e-3 / 2**20)  # compiled preferred over eager
    assert g["gpu_s_per_element"]["fp8_block"] == pytest.approx(9.0e-3 / 2**20)  # eager where compiled was skipped
    assert g["mfu"] == {"llama_600m": 0.35}  # a DP 64 rank's Newton-Schulz share, not the DP 1 step's
    k = costs(gpu_s_per_element=g["gpu_s_per_element"])
    c = replace(C, mem_gbs=g["mem_gbs"])
    fp8 = rows_by_name(("bf16",))["fp8/bf16"]
    assert ps.codec_time(fp8, 4, M, c, k) == pytest.approx(1e-3 / 2**20 * 3e9)
    nv = rows_by_name(("bf16",))["nvfp4/bf16"]  # no GPU row: the traced bytes at the measured bandwidth
    assert ps.codec_time(nv, 4, M, c, k) == pytest.approx(17.0 * 3e9 / 3e12)
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "project_scaling.py"), "--gpu-check", str(path), "--gpus", "64"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "MFU 0.350 of the compute" in res.stdout and "measured:" in res.stdout
    assert "device memory bandwidth 3000 GB/s" in res.stdout and "ps/element (measured:" in res.stdout
    with pytest.raises(ps.ProjectionError, match="dry run"):
        ps.load_gpu_check(str(_gpu_check_json(tmp_path, dry=True)))


# -- the CLI -----------------------------------------------------------------------------------------------------------
def test_cli_prints_every_assumption_and_a_table_per_dp_size(tmp_path):
    (tmp_path / "geo.txt").write_text(GEO)
    tool = [sys.executable, str(REPO / "tools" / "project_scaling.py"), "--geo-output", str(tmp_path / "geo.txt")]
    res = subprocess.run(tool + ["--markdown"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for text in (
        "Megatron-LM / PaLM: 6 x GEMM weights + 12 L s h",
        "MFU 0.400 of the compute",
        "fabric nvlink: 450 GB/s line rate per GPU per direction x 0.9 = 405 GB/s, 2 us per collective step",
        "fabric ndr200: 25 GB/s line rate per GPU per direction x 0.9 = 22.5 GB/s",
        "per-bucket timing: a micro-batch's forward 1/3 and backward 2/3",
        "windows: the gradient reduce-scatter hides only behind the last micro-batch's backward",
        "the wire-format registry (megatron_geo/comm/formats.py",
        "--ddp-reduce-scatter-with-fp32-accumulation",
        "symmetric-memory kernels",
        "not modelled: the optimizer step",
        "| gradient / parameters | nvlink 405 GB/s | ndr400 45 GB/s | ndr200 22.5 GB/s |",
        "check against the no-bucket arithmetic (llama_600m, DP 64, ndr200",
        "a faster fabric (more bandwidth, no more latency) never projects a longer step: holds",
    ):
        assert text in out, text
    for m in ("llama_300m", "llama_600m"):
        for n in (64, 256):
            assert f"\n{m}, DP {n}: " in out
    assert out.count("| fp8 / fp8 |") == 4 and out.count("| geofp8 / bf16 |") == 4
    assert str(REPO) not in out  # no absolute paths from the repository root
    res = subprocess.run(tool + ["--codec-output", str(tmp_path / "none.json")], capture_output=True, text=True)
    assert res.returncode == 2 and "none.json' not found" in res.stderr


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--gpus", "0"], "--gpus 0 must be >= 1"),
        (["--gpus", "3"], "global batch 512 does not split over 3 DP ranks"),
        (["--mfu", "1.5"], "--mfu 1.5"),
        (["--efficiency", "0"], "--efficiency 0.0 must be in (0, 1]"),
        (["--mem-gbs", "0"], "--mem-gbs 0.0 must be > 0"),
    ],
)
def test_bad_arguments_are_one_error_line(args, msg):
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "project_scaling.py"), *args], capture_output=True, text=True
    )
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr
