"""FP32/BF16 reducers against an FP64 reference reduce of the same per-rank inputs (gloo, 2-3 ranks)."""

import pytest
import torch

from dist_harness import run_distributed
from helpers import dp_pctx, pctx_for
from megatron_geo.comm import build_reducer


def _inputs(world: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # ranks differ by 1000x, as invariant 7 of docs/design.md section 3 asks
    return [torch.randn(n, generator=g, dtype=torch.float64) * (1000.0**r) for r in range(world)]


def _reduce(rank, world, dtype, n):
    """Both collectives in one spawn: [(buf, bytes) after reduce-scatter, (buf, bytes) after all-reduce]."""
    pctx = pctx_for(1)
    out = []
    for mode in ("rs", "ar"):
        red = build_reducer(dtype, pctx)
        buf = _inputs(world, n)[rank].float().clone()
        (red.reduce_scatter if mode == "rs" else red.all_reduce)(buf, async_op=True).wait()
        out.append((buf, red.bytes_sent))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reducer_matches_fp64_average(world, dtype):
    chunk = 7  # odd sizes on purpose
    n = world * chunk
    ref = torch.stack(_inputs(world, n)).mean(0)
    # relative tolerance: fp32 sum/div ~1e-6; bf16 wire rounds each input to 8 bits -> 2^-8 of the largest term
    tol = 1e-6 if dtype == "fp32" else 2.0**-8
    esize = 4 if dtype == "fp32" else 2
    scale = torch.stack(_inputs(world, n)).abs().max(0).values
    both = run_distributed(_reduce, world, dtype, n)
    rs, ar = [b[0] for b in both], [b[1] for b in both]
    for r, (buf, sent) in enumerate(rs):
        sl = slice(r * chunk, (r + 1) * chunk)
        assert ((buf[sl].double() - ref[sl]).abs() <= tol * scale[sl] + 1e-30).all()
        assert sent == (world - 1) * chunk * esize
    for buf, sent in ar:
        assert torch.equal(buf, ar[0][0]), "all-reduce results must be bitwise identical on every rank"
        assert ((buf.double() - ref).abs() <= 2 * tol * scale + 1e-30).all()
        assert sent == 2 * (world - 1) * chunk * esize


def _identical(rank, world, dtype):
    pctx = pctx_for(1)
    red = build_reducer(dtype, pctx)
    x = torch.linspace(-3, 3, 12)
    buf = x.clone()
    red.all_reduce(buf).wait()
    return x, buf


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_identical_inputs_round_trip(dtype):
    for x, buf in run_distributed(_identical, 2, dtype):
        expect = x if dtype == "fp32" else x.bfloat16().float()
        assert torch.equal(buf, expect)  # averaging of equal values is exact (sum then /2)


def test_bad_buffer_is_rejected():
    from megatron_geo.comm.reducer import FP32Reducer

    red = FP32Reducer(None, 2, 0)
    with pytest.raises(ValueError, match="dp_size"):
        red.reduce_scatter(torch.zeros(5))
    with pytest.raises(ValueError, match="comm.dtype"):
        build_reducer("fp7", dp_pctx(1))
