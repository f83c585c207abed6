"""Fidelity measurement: simulate_reduce against independent references, fidelity_metrics and bound-hit
counting on inputs with known answers, and both CLIs (grad_fidelity, profile_fp8_vulnerability) end to end."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from megatron_geo.analysis.fidelity import bound_hits, direction_errors, fidelity_metrics, simulate_reduce
from megatron_geo.comm.roundtrip import codec_label, parse_codec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_grads(shape, n, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    # ranks whose gradients differ by up to 1000x, so per-rank scales matter
    return [torch.randn(shape, generator=g) * (10.0 ** (3 * r / max(n - 1, 1)) if spread else 1.0) for r in range(n)]


# -- simulate_reduce ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(37, 11), (1000,), (3, 5, 7)])
def test_fp32_equals_fp64_mean(shape):
    grads = _rank_grads(shape, 3)
    ref = torch.stack([g.double() for g in grads]).mean(0)
    out = simulate_reduce(grads, {"dtype": "fp32"})
    assert out.dtype == torch.float32 and out.shape == torch.Size(shape)
    assert (out.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_fp32_with_hadamard_is_exact_up_to_rounding():
    grads = _rank_grads((19, 23), 2)  # 437 elements: padded to 4 blocks of 128
    ref = torch.stack([g.double() for g in grads]).mean(0)
    out = simulate_reduce(grads, {"dtype": "fp32", "transform": "hadamard", "hadamard_block": 128})
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def _torch_fp8(x, s):
    """Independent E4M3 round trip: torch's own cast of x / s (saturated at 448), times s."""
    return (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * s


def test_fp8_e4m3_tensor_scaling_matches_torch_cast_reference():
    grads = _rank_grads((33, 45), 4)
    acc = torch.zeros(33, 45)
    for g in grads:
        acc += _torch_fp8(g, g.abs().max() / 448.0)  # per-rank amax / 448 scale
    ref = acc / len(grads)
    out = simulate_reduce(grads, {"dtype": "fp8_e4m3", "scaling": "tensor"})
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0.0)
    assert (out - torch.stack(grads).mean(0)).abs().max() > 1e-3  # it did quantize


def test_fp8_e4m3_block_scaling_matches_torch_cast_reference():
    grads = _rank_grads((300,), 3)  # 300 = 2 blocks of 128 + a 44-element tail
    ref = torch.zeros(300)
    for g in grads:
        for lo in range(0, 300, 128):
            blk = g[lo : lo + 128]
            ref[lo : lo + 128] += _torch_fp8(blk, blk.abs().max() / 448.0)
    ref /= 3
    out = simulate_reduce(grads, "fp8_e4m3:block128")
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0.0)


def test_codec_spec_round_trip():
    for spec in [
        "fp8_e4m3:tensor",
        "fp8_e4m3:block128",
        "fp8_e5m2:tensor",
        "fp8_e4m3:tensor+hadamard128",
        "nvfp4",
        "bf16",
        "fp32",
        "fp8_e4m3:block64+hadamard256:stochastic",
    ]:
        assert codec_label(parse_codec(spec)) == spec
    with pytest.raises(ValueError):
        parse_codec("fp8_e4m3:blocky")
    with pytest.raises(ValueError):
        simulate_reduce([torch.zeros(3), torch.zeros(4)], "fp32")


def test_lossy_codecs_run_on_awkward_shapes():
    grads = _rank_grads((7, 9), 3)  # 63 elements: not a multiple of 16 or 128
    exact = torch.stack([g.double() for g in grads]).mean(0)
    for spec, tol in [
        ("nvfp4", 0.3),
        ("fp8_e4m3:tensor+hadamard128", 0.1),
        ("fp8_e5m2:block16:stochastic", 0.2),
        ("bf16", 0.01),
    ]:
        out = simulate_reduce(grads, spec)
        assert out.shape == (7, 9) and torch.isfinite(out).all()
        assert (out.double() - exact).norm() / exact.norm() < tol, spec
    zeros = [torch.zeros(5, 5)] * 2
    assert torch.equal(simulate_reduce(zeros, "nvfp4"), torch.zeros(5, 5))


# -- fidelity_metrics ---------------------------------------------------------------------------------
def test_metrics_of_scaled_gradient():
    eps = 1e-3
    grads = [torch.tensor([1.0, -2.0, 4.0]), torch.tensor([3.0, 0.0, 2.0])]  # mean [2, -1, 3]
    g = torch.tensor([2.0, -1.0, 3.0], dtype=torch.float64)
    m = fidelity_metrics(g * (1 + eps), grads)
    assert m["rel_l2"] == pytest.approx(eps, rel=1e-9)
    assert m["sqnr_db"] == pytest.approx(60.0, rel=1e-9)
    assert m["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert m["max_err"] == pytest.approx(3 * eps, rel=1e-9)
    assert m["dir_err_top"] is None and m["saturation"] is None  # 1-D, no codec
    exact = fidelity_metrics(g, grads)
    assert exact["rel_l2"] == 0.0 and math.isinf(exact["sqnr_db"])


def _orthonormal(n, seed):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def test_direction_errors_rank2():
    # Exactly representable rank-2 matrix: 3 u1 v1^T + 1 u2 v2^T with +-1/2 Hadamard vectors.
    u1, u2 = torch.tensor([1.0, 1, 1, 1]) / 2, torch.tensor([1.0, -1, 1, -1]) / 2
    v1, v2 = torch.tensor([1.0, 1, 1, 1]) / 2, torch.tensor([1.0, 1, -1, -1]) / 2
    g = 3 * torch.outer(u1, v1) + torch.outer(u2, v2)  # float32, exact
    u1, u2, v1, v2 = (t.double() for t in (u1, u2, v1, v2))
    a, b = 0.03, 0.2
    g_hat = (
        g.double() + a * torch.outer(u1, v1) + b * torch.outer(u2, v2) + 0.5 * torch.outer(u1, v2)
    )  # cross term: no effect
    m = fidelity_metrics(g_hat, [g, g])
    assert m["n_directions"] == 2  # the two zero singular values are excluded
    assert m["dir_err_top"] == pytest.approx(a / 3, rel=1e-9)
    assert m["dir_err_tail"] == pytest.approx(b / 1, rel=1e-9)


def test_direction_errors_quarters():
    # 8 directions, s = 8..1: top = first 2, tail = last 2, medians of two = their means
    u, v = _orthonormal(8, 1), _orthonormal(8, 2)
    s = torch.arange(8, 0, -1, dtype=torch.float64)
    g = u @ torch.diag(s) @ v.T
    d = torch.tensor([0.8, 2.4, 0.1, 0.1, 0.1, 0.1, 0.6, 0.3], dtype=torch.float64)  # u_i^T err v_i
    e = d / s
    m = direction_errors(g + u @ torch.diag(d) @ v.T, g)
    assert m["n_directions"] == 8
    assert m["dir_err_top"] == pytest.approx(float(e[:2].mean()), rel=1e-9)
    assert m["dir_err_tail"] == pytest.approx(float(e[-2:].mean()), rel=1e-9)


# -- bound hits ---------------------------------------------------------------------------------------
def test_bound_hits_known_counts():
    # amax 448 -> scale 1. E4M3's smallest subnormal is 2**-9 ~ 1.95e-3, so |x| < 2**-10 rounds to 0.
    x = torch.tensor([448.0, -448.0, 1.0, 1e-4, -5e-4, 2e-4, 0.0, 0.0, 1.5e-3, 3.0])
    h = bound_hits(x, {"dtype": "fp8_e4m3", "scaling": "tensor"})
    assert (h["saturated"], h["underflow"], h["nonzero"], h["elements"]) == (2, 3, 8, 10)
    assert h["saturation"] == pytest.approx(0.2) and h["underflow_fraction"] == pytest.approx(3 / 8)
    assert h["bound_hits"] == pytest.approx(0.2 + 3 / 8)
    # the same counts through fidelity_metrics over two ranks: rank 1 (all ones) adds no underflow
    m = fidelity_metrics(
        simulate_reduce([x, torch.ones(10)], "fp8_e4m3:tensor"), [x, torch.ones(10)], "fp8_e4m3:tensor"
    )
    assert m["underflow_count"] == 3 and m["nonzero"] == 18 and m["underflow"] == pytest.approx(3 / 18)
    assert m["saturated"] == 10  # every element of rank 1 is its amax: saturates on some rank everywhere


# -- CLIs ---------------------------------------------------------------------------------------------
_SMALL = ["model.num_layers=2", "model.seq_length=64", "train.global_batch_size=8", "train.micro_batch_size=4"]


def _run(args, tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_grad_fidelity_cli(tmp_path):
    out = tmp_path / "gf.json"
    stdout = _run(
        [
            "tools/grad_fidelity.py",
            "--warmup-steps",
            "3",
            "--ranks",
            "2",
            "--codecs",
            "fp8_e4m3:tensor",
            "nvfp4",
            "--out",
            str(out),
            *_SMALL,
        ],
        tmp_path,
    )
    assert "fp8_e4m3:tensor" in stdout and "RelL2" in stdout
    d = json.loads(out.read_text())
    assert d["warmup_steps"] == 3 and d["ranks"] == 2 and len(d["layers"]) == 2 * 7 + 1
    assert [c["codec"] for c in d["codecs"]] == ["fp8_e4m3:tensor", "nvfp4"]
    for c in d["codecs"]:
        o = c["overall"]
        for k in (
            "rel_l2",
            "mean_layer_rel_l2",
            "sqnr_db",
            "cosine",
            "max_err",
            "saturation",
            "underflow",
            "mean_layer_dir_err_top",
            "mean_layer_dir_err_tail",
        ):
            assert isinstance(o[k], float), k
        assert 0 < o["rel_l2"] < 0.5 and o["cosine"] > 0.9
        assert len(c["layers"]) == len(d["layers"])
        for layer in c["layers"]:
            assert {
                "name",
                "shape",
                "rel_l2",
                "sqnr_db",
                "cosine",
                "max_err",
                "saturation",
                "underflow",
                "dir_err_top",
                "dir_err_tail",
            } <= set(layer)
    fp8, nv = (c["overall"]["rel_l2"] for c in d["codecs"])
    assert nv > fp8  # 4-bit elements lose more than 8-bit


def test_profile_fp8_vulnerability_cli(tmp_path):
    out = tmp_path / "pv.json"
    stdout = _run(["tools/profile_fp8_vulnerability.py", "--steps", "3", "--out", str(out), *_SMALL], tmp_path)
    assert "bound hits" in stdout
    d = json.loads(out.read_text())
    assert d["format"] == "fp8_e4m3" and d["steps"] == 3
    names = [x["name"] for x in d["layers"]]
    assert len(names) == 2 * 7 + 2  # linear weights, embedding, output
    hits = [x["bound_hits"] for x in d["layers"]]
    assert hits == sorted(hits, reverse=True)
    for x in d["layers"]:
        assert x["bound_hits"] == pytest.approx(x["saturation"] + x["underflow"])
        assert 0 <= x["saturation"] <= 1 and 0 <= x["underflow"] <= 1


# -- GeoFP8 coordinate systems (simulate_geo_reduce and the --geo ablation) ------------------------------
from megatron_geo.analysis.coordinates import (  # noqa: E402
    BlockDiagonalTransform,
    DiagonalTransform,
    build_coordinate_transform,
    relative_damping,
)
from megatron_geo.analysis.fidelity import (  # noqa: E402
    geo_fidelity_metrics,
    input_gram_from_grads,
    output_factor_from_grads,
    simulate_geo_reduce,
    to_transformed,
)
from megatron_geo.geometry.transform import build_transform  # noqa: E402


def _anisotropic_layer(d_out=24, d_in=80, n_tok=160, ranks=3, seed=0):
    """Per-rank gradients G_r = delta_r^T a_r / n of a linear layer whose inputs span 4 decades of
    variance in a random basis, and the rank-averaged input factor A = mean_r a_r^T a_r / n."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=g))
    scale = torch.logspace(0, -2, d_in)
    acts = [(torch.randn(n_tok, d_in, generator=g) * scale) @ q.T for _ in range(ranks)]
    A = sum(a.T @ a for a in acts) / (n_tok * ranks)
    grads = [torch.randn(d_out, n_tok, generator=g) @ a / n_tok for a in acts]
    return A, grads


def test_exact_wire_every_coordinate_system_returns_the_fp64_average():
    A, grads = _anisotropic_layer()
    S = output_factor_from_grads(grads)
    ref = torch.stack([x.double() for x in grads]).mean(0)
    ins = [build_coordinate_transform(A, "lowrank", r, dmp) for r in (8, 32) for dmp in (1e-4, 1e-1)]
    ins += [
        build_coordinate_transform(A, "full", damping=1e-4),
        build_coordinate_transform(A, "diag"),
        build_coordinate_transform(A, "block", block=32),
        build_coordinate_transform(A, "block", block=128),
    ]
    ins += [
        build_coordinate_transform(A, "lowrank", 32, power=0.25),
        build_coordinate_transform(input_gram_from_grads(grads), "full", power=0.25),
    ]
    outs = [build_coordinate_transform(S, "lowrank", 8), build_coordinate_transform(S, "full", damping=1e-4)]
    combos = (
        [(None, None)] + [(t, None) for t in ins] + [(None, t) for t in outs] + [(ins[1], outs[0]), (ins[4], outs[1])]
    )
    for t_in, t_out in combos:
        out = simulate_geo_reduce(grads, "fp32", t_in, t_out)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
    # the transform really changes the wire, and FP8 through it is still a faithful reduce
    assert not torch.allclose(to_transformed(grads[0], ins[1], outs[0]), grads[0])
    m = geo_fidelity_metrics(grads, "fp8_e4m3:tensor", ins[1])
    assert 0 < m["rel_l2"] < 0.1 and m["dir_err_tail"] is not None and m["elements"] == grads[0].numel()


def test_geo_reduce_is_the_dense_two_sided_map():
    A, grads = _anisotropic_layer(d_out=12, d_in=20, ranks=2)
    t_in = build_coordinate_transform(A, "lowrank", 5)
    t_out = build_coordinate_transform(output_factor_from_grads(grads), "diag")
    Ti, To = t_in.dense().double(), t_out.dense().double()
    assert torch.allclose(to_transformed(grads[0].double(), *(None, None)), grads[0].double())
    w = to_transformed(grads[0], t_in, t_out).double()
    torch.testing.assert_close(w, To.T @ grads[0].double() @ Ti, rtol=1e-5, atol=1e-7)
    # the low-rank kind is the trainer's transform: build_transform with geo.damping x mean eigenvalue
    ref = build_transform(A, 5, 1e-3 * float(A.diagonal().mean()))
    assert torch.equal(t_in.U, ref.U) and torch.equal(t_in.d, ref.d)
    quarter = build_coordinate_transform(A, "lowrank", 5, power=0.25)  # D = ratio ** 1/4 = sqrt(GeoFP8's D)
    torch.testing.assert_close(quarter.d, ref.d.sqrt(), rtol=1e-6, atol=0.0)
    assert relative_damping(A, 0.5) == pytest.approx(0.5 * float(A.diagonal().double().mean()))
    S = output_factor_from_grads(grads)
    torch.testing.assert_close(S.double(), sum(x.double() @ x.double().T for x in grads) / (2 * 20))


def test_diagonal_and_block_diagonal_transforms_invert_exactly():
    A, _ = _anisotropic_layer(d_in=70, ranks=1)
    damp = relative_damping(A, 1e-3)
    t = build_coordinate_transform(A, "diag", damping=1e-3)
    assert isinstance(t, DiagonalTransform)
    a = A.diagonal().double()
    torch.testing.assert_close(t.s.double(), ((a.mean() + damp) / (a + damp)).sqrt(), rtol=1e-6, atol=0.0)
    x = torch.randn(9, 70, dtype=torch.float64)
    t64 = DiagonalTransform(t.s.double())
    torch.testing.assert_close(t64.apply_inverse(t64.apply(x)), x, rtol=1e-14, atol=1e-14)
    for block in (32, 128):  # 70 = 32 + 32 + 6 (an uneven last block) and one block of 70
        b = build_coordinate_transform(A, "block", block=block)
        assert isinstance(b, BlockDiagonalTransform) and b.d_in == 70
        assert [blk.d_in for blk in b.blocks] == ([32, 32, 6] if block == 32 else [70])
        dense = b.dense().double()
        inv = b.apply_inverse(torch.eye(70)).double()
        torch.testing.assert_close(inv @ dense, torch.eye(70, dtype=torch.float64), rtol=0, atol=1e-4)
        # each block is the full-rank damped transform of A's diagonal block: damp^1/2 (A_jj + damp I)^-1/2,
        # and nothing couples features of different blocks
        lo, hi = (32, 64) if block == 32 else (0, 70)
        ev, V = torch.linalg.eigh(A[lo:hi, lo:hi].double())
        ref = V @ torch.diag((damp / (ev.clamp(min=0) + damp)).sqrt()) @ V.T
        torch.testing.assert_close(dense[lo:hi, lo:hi], ref, rtol=0, atol=1e-5)
        if block == 32:
            mask = torch.block_diag(*[torch.ones(n, n) for n in (32, 32, 6)]).bool()
            assert torch.count_nonzero(dense[~mask]) == 0
        y = torch.randn(5, 70)
        torch.testing.assert_close(b.apply_inverse(b.apply(y)), y, rtol=1e-4, atol=1e-4)


def test_grad_fidelity_geo_cli(tmp_path):
    out, md = tmp_path / "geo.json", tmp_path / "geo.md"
    stdout = _run(
        [
            "tools/grad_fidelity.py",
            "--geo",
            "--warmup-steps",
            "2",
            "--ranks",
            "2",
            "--geo-staleness",
            "1",
            "--geo-lowranks",
            "8",
            "--geo-dampings",
            "1e-2",
            "--geo-blocks",
            "32",
            "--out",
            str(out),
            "--geo-power-search",
            "0.5,0.25,0",
            "--markdown",
            str(md),
            "model.num_layers=1",
            "model.seq_length=32",
            "model.vocab_size=512",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
        ],
        tmp_path,
    )
    assert "input-side geo r32" in stdout and "RelL2 reduction vs Euclidean >= 15%" in stdout
    assert "never worse than Euclidean when applied later (t+1: " in stdout
    assert "selected layers, fp8_e4m3:tensor; reduction" in stdout  # the codec the rows used
    assert (
        "powers chosen by the power search (A at t; selected layers): fp8_e4m3:tensor: layers.0.mlp.down_proj="
        in stdout
    )
    d = json.loads(out.read_text())
    g = d["geo"]
    assert d["mode"] == "geo" and g["selected_layers"] == ["layers.0.mlp.down_proj.weight"]
    labels = [r["label"] for r in g["rows"]]
    for want in (
        "Euclidean (baseline)",
        "input-side geo r32",
        "output-side geo r32",
        "two-sided geo r32",
        "input full (r = d_in)",
        "input diagonal",
        "input block-diag 32",
        "input low-rank 8",
        "input r32 damping 0.01",
        "input r32 from a sketch (k = 64)",
        "Euclidean @ t+1",
        "input r32, A stale (t) @ t+1",
        "NVFP4 Euclidean",
        "NVFP4 input-side geo r32",
        "input r32, D power 1/4",
        "input r32, grad Gram, power 1/4",
    ):
        assert want in labels, want
    for r in g["rows"]:
        assert len(r["layers"]) == 7 + 1
        for scope in ("selected", "all_linear"):
            o = r[scope]
            for k in (
                "rel_l2",
                "rel_l2_reduction_pct",
                "sqnr_db",
                "cosine",
                "mean_layer_dir_err_top",
                "mean_layer_dir_err_tail",
                "tail_ratio",
            ):
                assert isinstance(o[k], float), (r["label"], scope, k)
            assert 0 < o["rel_l2"] < 0.5
    assert g["rows"][0]["selected"]["rel_l2_reduction_pct"] == 0.0
    tg = g["targets"]
    assert set(tg) >= {"rel_l2_reduction_pct", "reduction_met", "staleness_reduction_pct", "staleness_never_worse"}
    default = next(r for r in g["rows"] if r["group"] == "default" and r["capture"] == 0)
    assert tg["row"] == default["label"] and tg["rel_l2_reduction_pct"] == default["selected"]["rel_l2_reduction_pct"]
    assert tg["staleness_never_worse"] == (tg["staleness_reduction_pct"]["1"] >= 0)
    assert g["capture_steps"] == {"0": 2, "1": 3}
    assert {"a_topr_trace_frac", "grad_energy_topr", "model_rel_l2_ratio"} <= set(g["diagnostics"][0])
    assert "| Euclidean (baseline) |" in md.read_text()
    # geo.power_search rows: each layer gets exactly the transform of the power it was assigned, so its
    # RelL2 equals that layer's RelL2 in the fixed-power row (0.5: GeoFP8, 0.25: D power 1/4, 0: Euclidean)
    by_label = {r["label"]: r for r in g["rows"]}
    search = by_label["input r32, geo.power_search=0.5,0.25,0"]
    assert "input r32, geo.power_search=0.5,0.25,0, chosen at t @ t+1" in by_label
    assert "NVFP4 input r32, power search" in by_label
    chosen = g["power_search_choices"]["A@t+0 fp8_e4m3:tensor"]
    assert len(chosen) == 8 and set(chosen.values()) <= {0.5, 0.25, 0.0}
    fixed = {0.5: "input-side geo r32", 0.25: "input r32, D power 1/4", 0.0: "Euclidean (baseline)"}
    for lay in search["layers"]:
        ref = {x["name"]: x for x in by_label[fixed[chosen[lay["name"]]]]["layers"]}[lay["name"]]
        assert lay["rel_l2"] == pytest.approx(ref["rel_l2"], rel=1e-3), lay["name"]


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--geo-power-search", "2", "--geo-power-search='2': '2' is not a power in [0, 1]"),
        ("--geo-power-search", "0.5,,0", "an empty element"),
        ("--geo-fp8-codec", "nvfp4", "--geo-fp8-codec='nvfp4': the FP8 rows need fp8_e4m3 or fp8_e5m2"),
        ("--geo-fp8-codec", "fp8_e4m3:block100", "power-of-two block"),
    ],
)
def test_grad_fidelity_geo_options_are_checked_before_training(flag, value, message):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "tools/grad_fidelity.py", "--geo", "--warmup-steps", "100", f"{flag}={value}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "warmup step" not in r.stdout and time.monotonic() - t0 < 60  # no training happened
