"""Fidelity measurement: simulate_reduce against independent references, fidelity_metrics and bound-hit
counting on inputs with known answers, and both CLIs (grad_fidelity, profile_fp8_vulnerability) end to end."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_geo.comm.fidelity import (bound_hits, codec_label, direction_errors, fidelity_metrics, parse_codec,
                                        simulate_reduce)

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
            blk = g[lo:lo + 128]
            ref[lo:lo + 128] += _torch_fp8(blk, blk.abs().max() / 448.0)
    ref /= 3
    out = simulate_reduce(grads, "fp8_e4m3:block128")
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0.0)


def test_codec_spec_round_trip():
    for spec in ["fp8_e4m3:tensor", "fp8_e4m3:block128", "fp8_e5m2:tensor", "fp8_e4m3:tensor+hadamard128",
                 "nvfp4", "bf16", "fp32", "fp8_e4m3:block64+hadamard256:stochastic"]:
        assert codec_label(parse_codec(spec)) == spec
    with pytest.raises(ValueError):
        parse_codec("fp8_e4m3:blocky")
    with pytest.raises(ValueError):
        simulate_reduce([torch.zeros(3), torch.zeros(4)], "fp32")


def test_lossy_codecs_run_on_awkward_shapes():
    grads = _rank_grads((7, 9), 3)  # 63 elements: not a multiple of 16 or 128
    exact = torch.stack([g.double() for g in grads]).mean(0)
    for spec, tol in [("nvfp4", 0.3), ("fp8_e4m3:tensor+hadamard128", 0.1), ("fp8_e5m2:block16:stochastic", 0.2),
                      ("bf16", 0.01)]:
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
    g_hat = g.double() + a * torch.outer(u1, v1) + b * torch.outer(u2, v2) + 0.5 * torch.outer(u1, v2)  # cross term: no effect
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
    m = fidelity_metrics(simulate_reduce([x, torch.ones(10)], "fp8_e4m3:tensor"), [x, torch.ones(10)],
                         "fp8_e4m3:tensor")
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
    stdout = _run(["tools/grad_fidelity.py", "--warmup-steps", "3", "--ranks", "2", "--codecs", "fp8_e4m3:tensor",
                   "nvfp4", "--out", str(out), *_SMALL], tmp_path)
    assert "fp8_e4m3:tensor" in stdout and "RelL2" in stdout
    d = json.loads(out.read_text())
    assert d["warmup_steps"] == 3 and d["ranks"] == 2 and len(d["layers"]) == 2 * 7 + 1
    assert [c["codec"] for c in d["codecs"]] == ["fp8_e4m3:tensor", "nvfp4"]
    for c in d["codecs"]:
        o = c["overall"]
        for k in ("rel_l2", "mean_layer_rel_l2", "sqnr_db", "cosine", "max_err", "saturation", "underflow",
                  "mean_layer_dir_err_top", "mean_layer_dir_err_tail"):
            assert isinstance(o[k], float), k
        assert 0 < o["rel_l2"] < 0.5 and o["cosine"] > 0.9
        assert len(c["layers"]) == len(d["layers"])
        for layer in c["layers"]:
            assert {"name", "shape", "rel_l2", "sqnr_db", "cosine", "max_err", "saturation", "underflow",
                    "dir_err_top", "dir_err_tail"} <= set(layer)
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
