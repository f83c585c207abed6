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


def test_register_bucket_returns_the_bucket_state():
    """``register_bucket`` returns the bucket's layout and the reducer's state for it; the reducer keeps that same
    object under the key, so the checkpoint entries and persistent-tensor names stay keyed as before."""
    from megatron_geo.comm.reducer import BucketReduction
    from megatron_geo.config.schema import CommConfig

    red = build_reducer(CommConfig(dtype="fp8_e4m3", error_feedback=True), dp_pctx(2))
    rb = red.register_bucket(3, [0], [4], 16, "cpu")  # one 4-element parameter; chunks of the 16-element granule
    assert isinstance(rb, BucketReduction)
    assert (rb.key, rb.offsets, rb.numels, rb.bounds, rb.device) == (3, [0], [4], [0, 16, 32], torch.device("cpu"))
    assert rb.even and red.registered == {3: rb} and red.bounds == {3: [0, 16, 32]}
    assert rb.residual is not None and rb.residual.dtype == torch.float32 and rb.residual.shape == (32,)
    assert red.layouts[3] is rb.layout and red.residuals[3] is rb.residual
    assert red.state_dict()["residuals"] == {3: rb.residual}
    assert {n.split("/")[1] for n in red.persistent_tensors()} == {"3"}

    plain = build_reducer("fp32", dp_pctx(2))
    other = plain.register_bucket(3, [0, 3], [3, 5], [0, 3, 8], "cpu")
    assert other.layout is None and other.residual is None and not other.even
    with pytest.raises(ValueError, match="not registered with this"):  # another reducer's bucket
        red.reduce_scatter(torch.zeros(32), other)
    with pytest.raises(ValueError, match="registered with 8 elements"):
        plain.reduce_scatter(torch.zeros(6), other)


def _by_object_and_key(rank, world):
    """An uneven bucket reduced through its registered object, then through its key: the same result."""
    pctx = pctx_for(1)
    out = []
    for how in ("object", "key"):
        red = build_reducer("fp32", pctx)
        rb = red.register_bucket(0, [0, 3], [3, 5], [0, 3, 8], "cpu")
        buf = _inputs(world, 8)[rank].float().clone()
        red.reduce_scatter(buf, rb if how == "object" else 0).wait()
        out.append((buf[rb.bounds[rank] : rb.bounds[rank + 1]].clone(), red.bytes_sent))
    return out


def test_bucket_object_and_key_reduce_alike():
    ref = torch.stack(_inputs(2, 8)).mean(0)
    for rank, (by_object, by_key) in enumerate(run_distributed(_by_object_and_key, 2)):
        assert torch.equal(by_object[0], by_key[0]) and by_object[1] == by_key[1]
        lo, hi = [0, 3, 8][rank], [0, 3, 8][rank + 1]
        assert torch.allclose(by_object[0].double(), ref[lo:hi], rtol=1e-6, atol=1e-30)
