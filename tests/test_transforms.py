"""The reducer's coordinate transforms (identity, block-Hadamard, GeoFP8) and the stateful components' state dicts.

- every transform maps a bucket to the wire coordinates and back to the input, to FP32 rounding, and its wire
  coordinates match an FP64 reference of the map (``x M`` for the rotation, ``G T`` with
  ``T = I + U (D - I) U^T`` for GeoFP8);
- the reducer's and the GeoFP8 state's ``state_dict()`` loads into a fresh instance with equal tensors, and the
  fresh reducer then quantises exactly like the original (same residual, same stochastic draws);
- ``comm`` and ``geometry`` never import each other (siblings in the package layering).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers import geo_state
from megatron_geo.comm.lowp import LowPrecisionReducer
from megatron_geo.comm.reducer import FP32Reducer
from megatron_geo.comm.transforms import HadamardTransform, IdentityTransform, build_transform
from megatron_geo.config.schema import CommConfig
from megatron_geo.geometry import GeoState, GeoTransform, LowRankTransform

ROOT = Path(__file__).resolve().parents[1] / "megatron_geo"


def _hadamard_fp64(b: int, signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) H_b / sqrt(b)`` in FP64 from the Sylvester recursion (independent of the package's builder)."""
    h = torch.tensor([[1.0]], dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return signs.double().view(b, 1) * h / math.sqrt(b)


class _TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 16, bias=False)
        self.down = nn.Linear(16, 24, bias=False)


def _orthonormal(d_in: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d_in, r, generator=g, dtype=torch.float64))
    return q


def _geo_state(model: nn.Module, **kw) -> GeoState:
    return geo_state(model, layers="*.weight", rank=4, damping=1e-3, refresh_interval=2, **kw)


def _bucket(model: nn.Module, pad: int = 8):
    """One bucket holding ``up.weight`` then ``down.weight`` (with ``pad`` elements between them)."""
    params = [model.up.weight, model.down.weight]
    offsets = [0, params[0].numel() + pad]
    numel = offsets[1] + params[1].numel()
    return SimpleNamespace(index=0, params=params, plan=SimpleNamespace(offsets=offsets)), numel


@pytest.mark.parametrize("name", ["identity", "hadamard"])
def test_fixed_transform_round_trip_and_wire_coordinates_match_fp64(name):
    b = 32
    t = IdentityTransform() if name == "identity" else HadamardTransform(b, seed=3)
    x = torch.randn(4 * b, generator=torch.Generator().manual_seed(0))
    wire = t.to_wire(x.clone(), 0).clone()
    if name == "identity":
        ref = x.double()
    else:
        ref = (x.double().view(-1, b) @ _hadamard_fp64(b, t.signs)).view(-1)
    torch.testing.assert_close(wire.double(), ref, rtol=0, atol=1e-6)
    back = t.from_wire(wire.clone(), 0, 0)
    torch.testing.assert_close(back.double(), x.double(), rtol=0, atol=1e-6)
    buf = torch.full_like(x, float("nan"))
    t.write_back(buf, 0, wire.clone(), 0)
    torch.testing.assert_close(buf.double(), x.double(), rtol=0, atol=1e-6)
    assert t.geo is None and t.transformed_layers(0) == []
    assert t.alignment() == (1 if name == "identity" else b)


def test_build_transform_names():
    assert isinstance(build_transform("none"), IdentityTransform)
    assert isinstance(build_transform("geo"), IdentityTransform)  # until the GeoFP8 state is attached
    assert isinstance(build_transform("hadamard", 16), HadamardTransform)
    with pytest.raises(ValueError, match="comm.transform='rot'"):
        build_transform("rot")


def test_geo_transform_round_trip_and_wire_coordinates_match_fp64():
    torch.manual_seed(0)
    model = _TwoLinear()
    geo = _geo_state(model)
    bucket, numel = _bucket(model)
    U = {"up.weight": _orthonormal(24, 4, 1), "down.weight": _orthonormal(16, 4, 2)}
    d = {
        "up.weight": torch.tensor([0.1, 0.3, 0.5, 0.9], dtype=torch.float64),
        "down.weight": torch.tensor([0.05, 0.2, 0.7, 1.0], dtype=torch.float64),
    }
    geo.load_state_dict({"transforms": {n: {"U": U[n].float(), "d": d[n].float()} for n in U}})
    t = GeoTransform(geo, [bucket])
    t.register_bucket(0, bucket.plan.offsets, [p.numel() for p in bucket.params], [0, numel], "cpu")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    wire = t.to_wire(x.clone(), 0)
    for name, p, off in zip(["up.weight", "down.weight"], bucket.params, bucket.plan.offsets):
        rows, cols = p.shape
        G = x[off : off + rows * cols].double().view(rows, cols)
        T = torch.eye(cols, dtype=torch.float64) + U[name] @ torch.diag(d[name] - 1) @ U[name].T  # FP64 reference
        torch.testing.assert_close(wire[off : off + rows * cols].double().view(rows, cols), G @ T, rtol=0, atol=1e-5)
    gap = slice(bucket.params[0].numel(), bucket.plan.offsets[1])
    assert torch.equal(wire[gap], x[gap])  # padding is no layer's: untouched
    assert [s[0] for s in t.transformed_layers(0)] == ["up.weight", "down.weight"]
    back = t.from_wire(wire.clone(), 0, 0)
    torch.testing.assert_close(back.double(), x.double(), rtol=0, atol=1e-5)
    buf = torch.zeros(numel)
    t.write_back(buf, 0, wire.clone(), 0)
    torch.testing.assert_close(buf.double(), x.double(), rtol=0, atol=1e-5)
    # a range that cuts a layer inside a row is refused
    with pytest.raises(RuntimeError, match="cut inside a row"):
        t.from_wire(wire[3:].clone(), 0, 3)


def test_geo_transform_rebases_the_tracked_residuals_at_a_refresh():
    torch.manual_seed(0)
    model = _TwoLinear()
    geo = _geo_state(model)
    bucket, numel = _bucket(model)
    t = GeoTransform(geo, [bucket])
    residual = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    before = residual.clone()
    t.track_residuals({0: residual})
    old = dict(geo.transforms)
    new = {
        n: LowRankTransform(_orthonormal(tt.U.shape[0], 3, 7).float(), torch.tensor([0.2, 0.5, 0.8]))
        for n, tt in old.items()
    }
    for fn in geo._listeners:  # what GeoState.refresh does after building the new transforms
        fn(old, new)
    off, (rows, cols) = bucket.plan.offsets[1], bucket.params[1].shape
    got = residual[off : off + rows * cols].view(rows, cols).double()
    Tn = new["down.weight"].dense().double()  # T_old = I: R <- R T_new
    torch.testing.assert_close(got, before[off : off + rows * cols].view(rows, cols).double() @ Tn, rtol=0, atol=1e-5)
    gap = slice(bucket.params[0].numel(), off)
    assert torch.equal(residual[gap], before[gap])


def _lowp(**kw):
    comm = CommConfig(dtype="fp8_e4m3", error_feedback=True, rounding="stochastic", compile="false", **kw)
    red = LowPrecisionReducer(comm, None, 2, 0, seed=11)
    red.register_bucket(0, [0, 32], [20, 30], [0, 32, 64], "cpu")
    red.register_bucket(1, [0], [48], [0, 32, 64], "cpu")
    return red


def test_reducer_state_dict_round_trip_into_a_fresh_reducer():
    red = _lowp()
    g = torch.Generator().manual_seed(2)
    for res in red.state_dict()["residuals"].values():
        res.copy_(torch.randn(res.numel(), generator=g))
    torch.rand(5, generator=red.generator)  # advance the stochastic-rounding generator
    sd = red.state_dict()
    fresh = _lowp()
    assert not torch.equal(fresh.state_dict()["generator"], sd["generator"])
    fresh.load_state_dict(
        {"residuals": {k: v.clone() for k, v in sd["residuals"].items()}, "generator": sd["generator"].clone()}
    )
    got = fresh.state_dict()
    assert sorted(got["residuals"]) == [0, 1]
    for k in sd["residuals"]:
        assert torch.equal(got["residuals"][k], sd["residuals"][k])
        assert got["residuals"][k].data_ptr() != sd["residuals"][k].data_ptr()  # copied in, not aliased
    assert torch.equal(got["generator"], sd["generator"])
    # the two now quantise alike: the same stochastic draws and the same residual update
    x = torch.randn(64, generator=g)
    outs = []
    for r in (red, fresh):
        codes, _, _ = r.wire.encode_ranges(x.clone().add_(r.residuals[0]), r.layouts[0], None, r.residuals[0])
        outs.append((codes[0][0].clone(), r.residuals[0].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_reducer_load_state_dict_rejects_unknown_buckets_and_sizes():
    red = _lowp()
    with pytest.raises(KeyError, match="bucket 7"):
        red.load_state_dict({"residuals": {7: torch.zeros(64)}})
    with pytest.raises(ValueError, match="residual of 10 elements"):
        red.load_state_dict({"residuals": {0: torch.zeros(10)}})
    plain = FP32Reducer(None, 2, 0)
    assert plain.state_dict() == {} and plain.geo is None
    plain.reset_error_feedback()  # a no-op, not an AttributeError
    plain.load_state_dict({})
    with pytest.raises(KeyError):
        plain.load_state_dict({"residuals": {0: torch.zeros(4)}})


def test_reset_error_feedback_zeroes_every_residual():
    red = _lowp()
    for res in red.state_dict()["residuals"].values():
        res.fill_(float("nan"))
    red.reset_error_feedback()
    assert all(torch.equal(r, torch.zeros_like(r)) for r in red.state_dict()["residuals"].values())


def test_geo_state_dict_round_trip_into_a_fresh_state():
    torch.manual_seed(0)
    model = _TwoLinear()
    geo = _geo_state(model, select="auto", num_layers=1, profile_steps=2)
    assert geo.profiling
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        geo.record_bound_hits("up.weight", torch.randn(16, 24, generator=g) * torch.logspace(-8, 2, 24))
        geo.record_bound_hits("down.weight", torch.randn(24, 16, generator=g))
        geo.end_profiled_step()
    geo.load_state_dict(
        {
            "selected": ["down.weight"],
            "last_refresh": 4,
            "transforms": {
                "down.weight": {"U": _orthonormal(16, 4, 4).float(), "d": torch.tensor([0.1, 0.2, 0.4, 0.8])}
            },
        }
    )
    sd = geo.state_dict()
    assert sd["profiled"] == 2 and sd["selected"] == ["down.weight"] and sd["last_refresh"] == 4
    assert sd["hits"]["up.weight"] > 0

    fresh = _geo_state(_TwoLinear(), select="auto", num_layers=1, profile_steps=2)
    fresh.load_state_dict({k: v for k, v in sd.items()})
    got = fresh.state_dict()
    assert got["hits"] == sd["hits"] and got["profiled"] == 2 and got["last_refresh"] == 4
    assert got["selected"] == ["down.weight"] and not fresh.profiling
    assert list(fresh.stats.modules) == ["down.weight"]  # statistics collectors follow the selection
    for n in sd["transforms"]:
        for k in ("U", "d"):
            assert torch.equal(got["transforms"][n][k], sd["transforms"][n][k])
    with pytest.raises(KeyError, match="not a geo.layers candidate"):
        fresh.load_state_dict({"hits": {"nope.weight": 1.0}})


def test_geo_state_gets_the_codec_round_trip_through_its_constructor():
    model = _TwoLinear()
    calls = []
    geo = _geo_state(model, roundtrip=lambda x: calls.append(x.shape) or x)
    assert geo.roundtrip(torch.ones(3)).shape == (3,) and calls == [(3,)]
    assert _geo_state(model).roundtrip is None


def _imports(pkg: str) -> set[str]:
    """The ``megatron_geo`` subpackages that the modules of ``pkg`` import (relative or absolute)."""
    out = set()
    for f in (ROOT / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 2 and node.module:
                    out.add(node.module.split(".")[0])
                elif node.level == 0 and node.module and node.module.startswith("megatron_geo."):
                    out.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("megatron_geo.")}
    return out


def test_comm_and_geometry_do_not_import_each_other():
    assert "geometry" not in _imports("comm")
    assert "comm" not in _imports("geometry") and "model" not in _imports("geometry")
