"""Gram Newton-Schulz (``optimizer.muon_ns=gram``) against the quintic iteration it rewrites.

The references are written here: a plain quintic Newton-Schulz loop (torch.optim.Muon's iteration, Jordan et al.
2024) in the requested precision, and the orthogonality error ``||O O^T - I||_F`` of an output measured in FP64.
"""

from __future__ import annotations

import math

import pytest
import torch

from ckpt_helpers import make_corpus, tiny_train_overrides
from megatron_geo.optim.muon import (
    MuonNS,
    build_muon,
    gram_newton_schulz,
    gram_restarts,
    newton_schulz_dtype,
    orthogonalize,
)

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = [(24, 80), (80, 24), (40, 40), (64, 192), (192, 64)]


def _quintic(u: torch.Tensor, dtype: torch.dtype, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Quintic Newton-Schulz written out: wide orientation, unit Frobenius norm, X <- aX + bAX + cA^2X."""
    a, b, c = COEFFS
    x = u.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(float(x.double().norm()), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if tall else x


def _orth_error(o: torch.Tensor) -> float:
    """``||O O^T - I||_F`` of the wide orientation of ``o``, in FP64."""
    o = o.double()
    o = o if o.shape[0] <= o.shape[1] else o.T
    return float((o @ o.T - torch.eye(o.shape[0], dtype=torch.float64)).norm())


def _ill_conditioned(shape, gen, decades: float = 6.0) -> torch.Tensor:
    """A random matrix of ``shape`` with singular values spread log-evenly over ``decades`` decades."""
    m = torch.randn(*shape, generator=gen, dtype=torch.float64)
    u, s, vt = torch.linalg.svd(m, full_matrices=False)
    return (u * torch.logspace(0, -decades, s.numel(), dtype=torch.float64)) @ vt


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_equals_the_quintic_in_fp64(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    for u in (torch.randn(*shape, generator=gen, dtype=torch.float64), _ill_conditioned(shape, gen)):
        want = _quintic(u, torch.float64)
        for restarts in (None, (), (1, 2, 3, 4)):  # the default restart, none, and one before every iteration
            got = gram_newton_schulz(u, COEFFS, 5, 1e-7, torch.float64, restarts=restarts)
            assert got.shape == u.shape and got.dtype == torch.float64
            assert float((got - want).norm() / want.norm()) < 1e-10, (shape, restarts)
    # other step counts (and their default restarts) too
    u = torch.randn(*shape, generator=gen, dtype=torch.float64)
    for steps in (0, 1, 2, 3, 8):
        want = _quintic(u, torch.float64, steps)
        got = gram_newton_schulz(u, COEFFS, steps, 1e-7, torch.float64)
        assert float((got - want).norm() / want.norm()) < 1e-10, steps


def test_restart_schedule_is_the_published_one_for_five_steps():
    assert gram_restarts(5) == (2,)
    assert gram_restarts(2) == ()
    assert gram_restarts(9) == (2, 5, 8)


@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (48, 160)])
def test_fp32_orthogonality_error_is_within_the_quintics(shape):
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    for kind, u in (
        ("random", torch.randn(*shape, generator=gen, dtype=torch.float64)),
        ("ill-conditioned", _ill_conditioned(shape, gen)),
    ):
        u32 = u.float()
        quintic = _orth_error(_quintic(u32, torch.float32))
        gram = _orth_error(gram_newton_schulz(u32, COEFFS, 5, 1e-7, torch.float32))
        exact = _orth_error(_quintic(u, torch.float64))  # what the 5-step quintic itself leaves (not 0)
        # both FP32 results sit on the FP64 value to FP32 rounding; gram is no worse than the quintic
        assert abs(quintic - exact) < 1e-4 * exact, (kind, quintic, exact)
        assert gram <= quintic * (1 + 1e-4), (kind, gram, quintic)


def test_bf16_gram_is_as_close_as_the_bf16_quintic_and_needs_the_restart():
    """BF16 (the CUDA default). With the published restart the output is no farther from the exact (FP64)
    quintic result than the BF16 quintic's own, and its orthogonality error is within 5% of the exact one;
    without the restart the carried Gram matrix drifts on an ill-conditioned input and the iteration blows up."""
    gen = torch.Generator().manual_seed(3)
    for shape in ((64, 192), (192, 64)):
        for kind, u in (
            ("random", torch.randn(*shape, generator=gen, dtype=torch.float64)),
            ("ill-conditioned", _ill_conditioned(shape, gen)),
        ):
            exact = _quintic(u, torch.float64)
            quintic = _quintic(u.float(), torch.bfloat16)
            gram = gram_newton_schulz(u.float(), COEFFS, 5, 1e-7, torch.bfloat16)
            assert gram.dtype == torch.bfloat16

            def dist(o):
                return float((o.double() - exact).norm() / exact.norm())

            assert dist(gram) <= 1.1 * dist(quintic), (shape, kind, dist(gram), dist(quintic))
            assert abs(_orth_error(gram) - _orth_error(exact)) < 0.05 * _orth_error(exact), (shape, kind)
            if kind == "ill-conditioned":
                no_restart = gram_newton_schulz(u.float(), COEFFS, 5, 1e-7, torch.bfloat16, restarts=())
                assert _orth_error(no_restart) > 10 * _orth_error(exact), (shape, _orth_error(no_restart))


def test_normalisation_is_done_before_the_cast():
    """A finite gradient above the BF16/FP16 range's square root still normalises (the norm is taken in FP32)."""
    gen = torch.Generator().manual_seed(4)
    u = torch.randn(16, 48, generator=gen) * 3e4
    out = gram_newton_schulz(u, COEFFS, 5, 1e-7, torch.float16)
    assert torch.isfinite(out).all()
    want = _quintic(u.double(), torch.float64)
    assert float((out.double() - want).norm() / want.norm()) < 0.05


def test_orthogonalize_dispatch_and_errors():
    gen = torch.Generator().manual_seed(5)
    sq = torch.randn(24, 24, generator=gen)
    # square: the quintic (the published method uses the Gram form on rectangular matrices only)
    assert torch.equal(orthogonalize(sq, "gram", COEFFS, 5, 1e-7, torch.float32), _quintic_like_torch(sq))
    with pytest.raises(ValueError, match="optimizer.muon_ns='cubic'"):
        orthogonalize(sq, "cubic", COEFFS, 5, 1e-7, torch.float32)
    with pytest.raises(ValueError, match="optimizer.muon_ns"):
        MuonNS([torch.nn.Parameter(sq.clone())], ns="cubic")


def _quintic_like_torch(u):
    """The quintic as torch.optim.Muon orders its FP32 operations (addmm), for a bitwise comparison."""
    a, b, c = COEFFS
    x = u.float()
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        g = x @ x.T
        x = a * x + (b * g + c * (g @ g)) @ x
    return x


def test_build_muon_choices():
    from megatron_geo.config import ConfigError
    from megatron_geo.config.schema import OptimizerConfig

    p = [torch.nn.Parameter(torch.zeros(4, 8))]

    def dtype(spec, device):
        return newton_schulz_dtype(OptimizerConfig(muon_ns_dtype=spec), device)

    assert type(build_muon(p, ns_dtype=dtype("auto", "cuda"))) is torch.optim.Muon  # quintic: torch's own on CUDA
    cpu = build_muon(p, ns_dtype=dtype("auto", "cpu"))
    assert type(cpu) is MuonNS and cpu.ns == "quintic" and cpu.ns_dtype == torch.float32
    for device, spec, want in (
        ("cuda", "auto", torch.bfloat16),
        ("cpu", "auto", torch.float32),
        ("cuda", "fp32", torch.float32),
        ("cpu", "bf16", torch.bfloat16),
    ):
        o = build_muon(p, ns_dtype=dtype(spec, torch.device(device)), ns="gram")
        assert type(o) is MuonNS and o.ns == "gram" and o.ns_dtype == want, (device, spec)
    with pytest.raises(ValueError, match="optimizer.muon_ns='x'"):
        build_muon(p, ns="x")
    with pytest.raises(ConfigError, match="optimizer.muon_ns_dtype='fp16' is not supported"):
        dtype("fp16", "cpu")
    with pytest.raises(ValueError, match="neither torch.bfloat16 nor torch.float32"):
        build_muon(p, ns_dtype=torch.float16)


def test_gram_muon_state_is_the_momentum_buffer_only_and_updates_like_the_quintic():
    gen = torch.Generator().manual_seed(6)
    w0 = torch.randn(32, 96, generator=gen)
    grads = [torch.randn(32, 96, generator=gen) for _ in range(3)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    wq, wg = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oq, og = MuonNS([wq], ns="quintic", **kw), MuonNS([wg], ns="gram", **kw)
    for g in grads:
        wq.grad, wg.grad = g.clone(), g.clone()
        oq.step()
        og.step()
    assert set(og.state[wg]) == {"momentum_buffer"}
    assert torch.equal(og.state[wg]["momentum_buffer"], oq.state[wq]["momentum_buffer"])
    upd = float((wq.detach() - w0).norm())
    assert float((wg.detach() - wq.detach()).norm()) < 1e-5 * upd
    sq, sg = oq.state_dict(), og.state_dict()
    assert sq["param_groups"] == sg["param_groups"]  # a checkpoint of one loads into the other


SEEDS = (0, 1, 2)
T_975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (3 seeds)


def test_three_seed_tiny_runs_have_indistinguishable_final_validation_loss(tmp_path, world, one_thread, capsys):
    """Muon at DP=1, 30 steps of the small test model: the paired (gram - quintic) final validation losses.

    Bound: the two forms are the same update up to FP32 rounding, so their difference must be far below the
    seed-to-seed spread of the final loss (the noise any comparison of runs has). The test asserts
    ``|mean diff| < 0.1 x`` that spread (its sample standard deviation over the 3 quintic runs) and that the 95%
    t-interval of the mean difference lies inside ``+-`` that spread.
    """
    from helpers import pctx_for
    from megatron_geo.config import load_config
    from megatron_geo.training.trainer import train
    from megatron_geo.training.validate import validate_config

    data = make_corpus(tmp_path / "corpus")
    losses: dict[str, list[float]] = {"quintic": [], "gram": []}
    for seed in SEEDS:
        for ns in losses:
            cfg = load_config(
                [],
                tiny_train_overrides(
                    tmp_path / f"{ns}_{seed}",
                    data,
                    "optimizer.name=muon",
                    "optimizer.lr=0.01",
                    f"optimizer.muon_ns={ns}",
                    f"train.seed={seed}",
                    "train.steps=30",
                    "train.eval_interval=30",
                    "train.eval_batches=4",
                    "checkpoint.save_at_end=false",
                ),
            )
            validate_config(cfg, 1)
            losses[ns].append(float(train(cfg, pctx_for(1))["val_loss"]))
    diffs = [g - q for g, q in zip(losses["gram"], losses["quintic"])]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = T_975_DF2 * sd / math.sqrt(n)
    qm = sum(losses["quintic"]) / n
    spread = math.sqrt(sum((x - qm) ** 2 for x in losses["quintic"]) / (n - 1))
    with capsys.disabled():
        print(
            f"\nfinal validation loss, quintic {losses['quintic']}, gram {losses['gram']}\n"
            f"paired gram - quintic: mean {mean:.3e}, 95% t-interval [{mean - half:.3e}, {mean + half:.3e}]; "
            f"seed-to-seed sd {spread:.3e}"
        )
    assert spread > 0, "the seeds gave the same loss: the runs did not depend on train.seed"
    assert abs(mean) < 0.1 * spread, (mean, spread)
    assert -spread < mean - half and mean + half < spread, (mean, half, spread)
