"""Bucket reductions are matched by bucket, never by arrival order.

DP = 2, four 64-element parameters, one per bucket, overlap on; on rank 1 the second parameter takes no part
in the forward (a data-dependent branch), so its gradient never arrives there. Every bucket's average must
still be the mean of the two ranks' gradients (the unused parameter's gradient counts as zero on rank 1),
computed here independently as (g_0 + g_1) / 2 from each rank's own autograd gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_harness import run_distributed
from helpers import pctx_for


def _run(rank, world, dtype, sharded, skip):
    from megatron_geo.comm import build_reducer
    from megatron_geo.distributed import GradSync, build_buckets, register_buckets

    pctx = pctx_for(1)
    torch.manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.randn(64)) for _ in range(4)])
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    reducer = build_reducer(dtype, pctx)
    buckets = build_buckets(named, 64, world, atomic_fn=lambda p: False, align=reducer.alignment())
    register_buckets(reducer, buckets, "cpu")
    sync = GradSync(buckets, reducer, sharded=sharded)
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(64, generator=g) for _ in range(4)]
    sync.start_step()
    sync.set_last_micro_batch(True)
    used = [i for i in range(4) if not (rank == 1 and i in skip)]
    loss = sum((params[i] * xs[i]).sum() * (i + 1) for i in used)
    loss.backward()
    local = {f"p{i}": (xs[i] * (i + 1) if i in used else torch.zeros(64)) for i in range(4)}
    sync.finish()
    if sharded:
        owned = {}
        for b in buckets:
            lo, hi = b.plan.bounds[rank], b.plan.bounds[rank + 1]
            for p, name, off in zip(b.params, b.names, b.plan.offsets):
                s, e = max(off, lo), min(off + p.numel(), hi)
                if s < e:
                    owned[(name, s - off, e - off)] = b.grad_data[s:e].clone()
        return local, owned
    return local, {(n, 0, 64): p.main_grad.clone() for n, p in named}


@pytest.mark.parametrize("dtype,sharded", [("fp32", True), ("fp32", False), ("bf16", True)])
@pytest.mark.parametrize("skip", [(1,), (0, 2)], ids=["second-unused", "first-and-third-unused"])
def test_unused_parameter_on_one_rank_gives_the_right_averages(dtype, sharded, skip):
    out = run_distributed(_run, 2, dtype, sharded, skip)
    ref = {n: (out[0][0][n].double() + out[1][0][n].double()) / 2 for n in out[0][0]}
    tol = 1e-6 if dtype == "fp32" else 2.0**-7
    seen = 0
    for _, owned in out:
        for (name, s, e), got in owned.items():
            want = ref[name][s:e]
            assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max().item()), (name, got, want)
            seen += 1
    assert seen >= 4
