"""The wire-format registry (megatron_geo/comm/formats.py).

- Every ``configs/comm`` preset's ``comm.dtype`` is registered, and the registry's alignment is the reducer's.
- The checklist of ``docs/extending.md`` is enough: a toy format (symmetric int8 codes, one FP32 scale per
  parameter) defined here with nothing but a wire class, one ``register_format`` call and a preset YAML validates,
  reduce-scatters a bucket at DP = 2 to the FP64 mean within its rounding, round-trips per tensor, and is named by
  the run label and the codec table, with its alignment and wire bytes taken from its entry.
- The per-tensor round trip (``comm/roundtrip.py``) is the bucket path: at DP = 2 with the same gradient on both
  ranks the reducer returns one rank's round trip, so ``simulate_reduce`` must equal the reducer bitwise, for every
  preset codec (the Hadamard rotation included: the bucket path's matmul, not the butterfly reference).
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from torch import Tensor

from dist_harness import run_distributed
from helpers import pctx_for
from megatron_geo.analysis.codec_table import bytes_per_element_of, evaluate_codec, format_table
from megatron_geo.analysis.fidelity import simulate_reduce
from megatron_geo.comm.factory import build_reducer
from megatron_geo.comm.formats import (
    FORMATS,
    Wire,
    WireFormat,
    comm_alignment,
    get_format,
    register_format,
)
from megatron_geo.comm.lowp import LowPrecisionReducer
from megatron_geo.comm.roundtrip import codec_label, normalize_codec, parse_codec, quantize_roundtrip, quantize_wire
from megatron_geo.comm.scale_layout import ScaleLayout
from megatron_geo.config import ConfigError, load_config
from megatron_geo.config.label import derive_label
from megatron_geo.config.presets import codec_presets, comm_presets, preset_config
from megatron_geo.distributed.shard_plan import plan_shards
from megatron_geo.training.validate import validate_config

# -- a toy wire format: the whole of what adding one takes (besides docs) -----------------------------------------

INT8_MAX = 127.0


class Int8Wire:
    """Symmetric int8 codes ``round(x / s)`` (ties to even, clamped to +-127) with one FP32 scale ``s = amax / 127``
    per scale segment (1 for an all-zero one); the wire views the buffer as ``[blocks, layout.granule]``."""

    def __init__(self, comm, generator, compile):
        self.comm = comm

    @staticmethod
    def _scales(amax: Tensor) -> Tensor:
        return torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))

    @staticmethod
    def _encode(x2: Tensor, bscale: Tensor) -> Tensor:
        return torch.round(x2 / bscale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).view(torch.uint8)

    @staticmethod
    def _decode(codes: Tensor, bscale: Tensor) -> Tensor:
        return (codes.view(torch.int8).float() * bscale.unsqueeze(-1)).reshape(-1)

    def encode_ranges(self, x, layout: ScaleLayout, sync_amax=None, residual=None):
        x2 = x.view(-1, layout.granule)
        seg = layout.segment_values(self._scales(layout.group_amax(x2.abs().amax(dim=1))))
        bscale = layout.block_values(seg)
        codes = self._encode(x2, bscale)
        if residual is not None:
            residual.copy_(x - self._decode(codes, bscale))
        return [(codes.view(-1), list(layout.sizes))], (seg.contiguous().view(-1), layout.scale_splits()), None

    def roundtrip(self, x, layout):
        x2 = x.view(-1, layout.granule)
        bscale = layout.block_values(layout.segment_values(self._scales(layout.group_amax(x2.abs().amax(dim=1)))))
        return self._decode(self._encode(x2, bscale), bscale)

    def decode_own(self, recv, scales, layout, r, out):
        dp, g = scales.shape[0], layout.granule
        codes = recv[0].view(dp, -1, g)
        vals = codes.view(torch.int8).float() * layout.row_block_values(scales, r).unsqueeze(2)
        return out.copy_(vals.sum(dim=0).div_(dp).view(-1))

    def encode_chunk(self, x, layout, r):
        x2 = x.view(-1, layout.granule)
        seg = self._scales(layout.row_segment_amax(x2.abs().amax(dim=1), r))
        codes = self._encode(x2, layout.row_block_values(seg, r))
        return torch.cat([codes.view(1, -1), seg.view(1, -1).view(torch.uint8)], dim=1)

    def decode_all(self, out, layout):
        c = layout.chunk
        seg = out[:, c:].clone(memory_format=torch.contiguous_format).view(torch.float32)
        return self._decode(out[:, :c].reshape(-1, layout.granule), layout.block_values(seg))

    def saturated(self, x, payload, layout):
        return payload[0, : x.numel()].view(torch.int8).abs() == INT8_MAX


def register_int8() -> WireFormat:
    """The toy format's one registry entry (a spawned DP rank calls it again: registration is per process)."""
    return register_format(
        WireFormat(name="int8", make_wire=Int8Wire, alignment=lambda comm: 16, bytes_per_element=lambda comm: 1.0)
    )


@pytest.fixture
def int8(tmp_path):
    """The toy format registered for one test, and its preset ``<tmp>/comm/int8.yaml``."""
    register_int8()
    preset = tmp_path / "comm" / "int8.yaml"
    preset.parent.mkdir()
    preset.write_text("# preset: int8 (symmetric int8 codes, one FP32 scale per parameter)\ncomm:\n  dtype: int8\n")
    yield preset
    FORMATS.pop("int8", None)


NUMELS = [40, 7, 1, 0, 61]


def _rank_grads(world: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(3)
    out = []
    for r in range(world):
        x = torch.randn(sum(NUMELS), generator=g, dtype=torch.float64)
        x[:3] *= 40  # a few large entries set the first parameter's scale
        out.append(x * (10.0**r))
    return out


def _toy_reduce_scatter(rank, world, preset):
    register_int8()
    cfg = load_config([preset])
    red = build_reducer(cfg.comm, pctx_for(1))
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
    bucket = red.register_bucket(0, plan.offsets, NUMELS, plan.chunk, "cpu")
    buf = torch.zeros(plan.buffer_numel)
    grads = _rank_grads(world)
    for off, n, lo in zip(plan.offsets, NUMELS, itertools.accumulate([0] + NUMELS)):
        buf[off : off + n] = grads[rank][lo : lo + n].float()
    red.reduce_scatter(buf, bucket).wait()
    lo, hi = plan.chunk * rank, plan.chunk * (rank + 1)
    return type(red).__name__, red.alignment(), plan.offsets, lo, buf[lo:hi].clone()


def test_a_format_added_with_a_wire_class_an_entry_and_a_preset_works_end_to_end(int8):
    fmt = get_format("int8")
    assert isinstance(Int8Wire(None, None, False), Wire)

    # config validation accepts it, rejects what its entry does not support, and lists it for an unknown dtype
    cfg = load_config([str(int8)])
    validate_config(cfg, 2)
    assert cfg.comm.dtype == "int8" and cfg.comm.label == "int8"  # the preset's name
    assert derive_label(cfg) == "int8"
    for bad, match in (
        (["comm.scaling=block"], "comm.scaling=block does not apply to comm.dtype=int8"),
        (["comm.reduce_op=wire_sum"], "wire_sum .* got comm.dtype=int8"),
        (["comm.scale_sync=max"], "comm.scale_sync=max is supported for fp8_e4m3, fp8_e5m2 only"),
    ):
        with pytest.raises(ConfigError, match=match):
            validate_config(load_config([str(int8)], bad), 2)
    with pytest.raises(ConfigError, match=re.escape("choose one of " + ", ".join(FORMATS))) as e:
        validate_config(load_config([], ["comm.dtype=int9"]), 2)
    assert "int8" in str(e.value)  # the new entry is among the choices
    validate_config(load_config([str(int8)], ["comm.error_feedback=true", "comm.rounding=stochastic"]), 2)

    # alignment and wire bytes come from the entry
    assert comm_alignment(cfg.comm) == 16 == fmt.alignment(cfg.comm)
    assert comm_alignment(load_config([str(int8)], ["comm.transform=hadamard", "comm.hadamard_block=64"]).comm) == 64
    assert bytes_per_element_of(normalize_codec("int8")) == 1.0

    # build_reducer reduce-scatters a bucket at DP = 2: the FP64 mean within int8's rounding (half a scale per rank)
    out = run_distributed(_toy_reduce_scatter, 2, str(int8))
    grads = _rank_grads(2)
    mean = sum(grads) / 2
    bound = torch.zeros(sum(NUMELS), dtype=torch.float64)
    pos = 0
    for n in NUMELS:
        for g in grads:
            if n:
                bound[pos : pos + n] += g[pos : pos + n].float().abs().max().double() / INT8_MAX / 2 / 2
        pos += n
    errs = []
    for name, align, offsets, lo, shard in out:
        assert name == "LowPrecisionReducer" and align == 16
        pos = 0
        for off, n in zip(offsets, NUMELS):
            for i in range(n):
                j = off + i - lo
                if 0 <= j < shard.numel():
                    err = abs(float(shard[j]) - float(mean[pos + i]))
                    tol = float(bound[pos + i]) * (1 + 1e-5) + abs(float(mean[pos + i])) * 1e-6
                    assert err <= tol, (pos + i, err, float(bound[pos + i]))
                    errs.append(err)
            pos += n
    assert len(errs) == sum(NUMELS) and max(errs) > 0  # every element reduced once, and really quantised

    # the per-tensor round trip runs the same wire class: exact on a hand-made vector (scale 1, ties to even)
    x = torch.tensor([127.0, -63.5, 0.2, 1.0, 2.5, -127.0])
    assert torch.equal(quantize_roundtrip(x, "int8"), torch.tensor([127.0, -64.0, 0.0, 1.0, 2.0, -127.0]))
    dec, sat = quantize_wire(x, normalize_codec("int8"), 0)
    assert sat.tolist() == [True, False, False, False, False, True]

    # the codec spec, the codec table and the label name it
    assert codec_label(parse_codec("int8")) == "int8"
    grads2 = {"w": [torch.randn(8, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]}
    res = evaluate_codec(normalize_codec("int8"), ["w"], grads2, directions=False)
    table = format_table([{"codec": "int8", "bytes_per_element": bytes_per_element_of(normalize_codec("int8")), **res}])
    assert any(line.startswith("int8") and " 1.000 " in line for line in table.splitlines())


def test_every_preset_format_is_registered_with_the_reducers_alignment():
    presets = comm_presets()
    assert len(presets) >= 13
    want = {
        "fp8": 16,
        "fp8_ef": 16,
        "fp8_shared_scale": 16,
        "fp8_e5m2": 16,
        "geofp8": 128,
        "geofp8_tensor": 16,
        "fp8_block": 128,
        "nvfp4": 16,
        "geonvfp4": 16,
        "fp8_hadamard": 128,
        "fp32": 1,
        "bf16": 1,
    }
    for name in presets:
        c = preset_config(name).comm
        assert c.dtype in FORMATS, name
        red = LowPrecisionReducer(dataclasses.replace(c, compile="false"), None, 2, 0)
        assert comm_alignment(c) == red.alignment(), name
        if name in want:
            assert comm_alignment(c) == want[name], name


def test_fp8_entries_carry_their_limits_and_unknown_names_list_the_choices():
    e4, e5 = get_format("fp8_e4m3"), get_format("fp8_e5m2")
    assert (e4.fp8_max, e4.underflow_below, e5.fp8_max, e5.underflow_below) == (448.0, 2.0**-10, 57344.0, 2.0**-17)
    # half the smallest subnormal, from torch's own casts: it flushes to zero, the next value up does not
    for fmt, dt in ((e4, torch.float8_e4m3fn), (e5, torch.float8_e5m2)):
        u = torch.tensor([fmt.underflow_below, fmt.underflow_below * 1.0001])
        assert u.to(dt).float().tolist() == [0.0, fmt.underflow_below * 2]
        assert torch.finfo(dt).max == fmt.fp8_max
    assert get_format("nvfp4").fp8_max is None and get_format("bf16").underflow_below is None
    with pytest.raises(ValueError, match=re.escape("choose one of " + ", ".join(FORMATS))):
        get_format("fp4")


def _codec_of(comm) -> dict:
    return {
        "dtype": comm.dtype,
        "scaling": comm.scaling,
        "block_size": comm.block_size,
        "transform": comm.transform,
        "hadamard_block": comm.hadamard_block,
        "rounding": comm.rounding,
    }


def _same_gradient_reduce(rank, world, names):
    out = {}
    for name in names:
        comm = preset_config(name).comm
        red = build_reducer(comm, pctx_for(1), seed=0)
        n = 1000
        plan = plan_shards([n], [False], world, red.alignment())
        bucket = red.register_bucket(0, plan.offsets, [n], plan.chunk, "cpu")
        g = torch.randn(n, generator=torch.Generator().manual_seed(11)) ** 3  # the same on both ranks
        buf = torch.zeros(plan.buffer_numel)
        buf[:n] = g
        red.reduce_scatter(buf, bucket).wait()
        out[name] = (plan.chunk * rank, buf[plan.chunk * rank : plan.chunk * (rank + 1)].clone(), g)
    return out


def test_per_tensor_round_trip_is_the_bucket_path_for_every_preset_codec():
    names = codec_presets()
    ranks = run_distributed(_same_gradient_reduce, 2, names)
    for name in names:
        codec = _codec_of(preset_config(name).comm)
        g = ranks[0][name][2]
        ref = simulate_reduce([g, g], codec)  # to_wire, quantize_wire, sum over ranks / 2, from_wire
        got = torch.cat([ranks[r][name][1] for r in range(2)])[: g.numel()]
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (
            name,
            int((got.view(torch.int32) != ref.view(torch.int32)).sum()),
        )
