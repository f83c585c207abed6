"""Muon matrices split by rows over a small group of DP ranks: the split Newton-Schulz against the unsplit
``orthogonalize`` in one process (simulated groups), the plan's split rule and FLOP model, and the full
optimizer step of a split plan against the whole-matrix plan with real gloo processes (checkpoints included)."""

from __future__ import annotations

import pytest
import torch

from megatron_geo.optim.muon import orthogonalize
from megatron_geo.optim.split_ns import even_cuts, local_group, split_orthogonalize

COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's
EPS = 1e-7
U32 = 2.0**-24  # unit roundoff
U64 = 2.0**-53

# -- split Newton-Schulz in one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (48, 48)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("ns", ["quintic", "gram"])
def test_split_newton_schulz_equals_the_unsplit_one(shape, g, ns):
    """The tolerance is derived from the iteration's own rounding: the unsplit FP32 result's distance to the FP64
    one is ``kappa * u32`` (kappa: how much the 5 steps amplify one rounding). The split run rounds the same
    operations in another order, an error of the same size: its distance to the FP64 result must be within 4x
    the unsplit one's (the max over elements of another draw), and in FP64 split and unsplit must agree to
    ``4 kappa u64``."""
    gen = torch.Generator().manual_seed(hash((shape, g, ns)) % 2**31)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    ref64 = orthogonalize(w, ns, COEFFS, 5, EPS, torch.float64)
    err32 = (orthogonalize(w.float(), ns, COEFFS, 5, EPS, torch.float32).double() - ref64).abs().max().item()
    kappa = err32 / U32
    cuts = even_cuts(shape[0], g)
    all_reduce, exchange = local_group(g)
    calls = []

    def counted(parts):
        calls.append(parts[0].shape)
        return all_reduce(parts)

    for dtype, bound in ((torch.float32, 4 * err32), (torch.float64, 4 * kappa * U64)):
        blocks = [w[cuts[i] : cuts[i + 1]].to(dtype) for i in range(g)]
        calls.clear()
        out = split_orthogonalize(blocks, range(g), cuts, ns, COEFFS, 5, EPS, dtype, counted, exchange)
        assert all(o.dtype == dtype for o in out)
        got = torch.cat(out).double()
        assert got.shape == w.shape
        err = (got - ref64).abs().max().item()
        assert err <= bound, (dtype, err, bound)
        m = min(shape)
        assert all(s == (m, m) for s in calls), calls  # only the small Gram travels
        gram_form = ns == "gram" and shape[0] != shape[1]
        assert len(calls) == (2 if gram_form else 5)  # gram: start + one restart; quintic: one per step


def test_split_newton_schulz_rejects_bad_blocks():
    ar, ex = local_group(2)
    w = torch.randn(10, 4)
    with pytest.raises(ValueError, match="row_cuts"):
        split_orthogonalize([w[:4], w[4:]], [0, 1], [0, 5, 10], "quintic", COEFFS, 5, EPS, torch.float32, ar, ex)
    with pytest.raises(ValueError, match="muon_ns"):
        split_orthogonalize([w[:5], w[5:]], [0, 1], [0, 5, 10], "cubic", COEFFS, 5, EPS, torch.float32, ar, ex)
