"""The ``--geo`` ablation of ``tools/grad_fidelity.py``: coordinate-system rows (Euclidean, input-, output-
and two-sided GeoFP8, full / diagonal / block-diagonal / low-rank / sketched factors, damping, staleness,
power search, NVFP4), each evaluated on every layer of a capture (:class:`Capture`: per-rank gradients and
the K-FAC input factor of one step, from the model or a synthetic scenario), and per-layer diagnostics.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass

import torch

from ..comm.formats import FORMATS, get_format
from ..comm.roundtrip import codec_label, is_pow2, parse_codec, quantize_roundtrip
from ..geometry import refresh_stats as RS
from ..geometry.power_search import pick_powers, roundtrip_errors, with_power
from .capture import Capture
from .coordinates import build_coordinate_transform
from .fidelity import (
    fidelity_metrics,
    geo_reduce_and_metrics,
    input_gram_from_grads,
    output_factor_from_grads,
    simulate_reduce,
)
from .report_io import finite_mean

GEO_FP8 = "fp8_e4m3:tensor"
GEO_FP4 = "nvfp4"
TARGET_REDUCTION_PCT = 15.0  # the geofp8 default's target: at least 15% below Euclidean FP8 on the tiny model
PAPER_REDUCTION_PCT = 67.4  # the paper's one-step figure at r = 32 (its own regime: dense spikes, E5M2)


def _side(
    kind: str,
    rank: int | None = None,
    block: int | None = None,
    damping: float = 1e-3,
    power: float | str = 0.5,
    factor: str = "kfac",
) -> dict:
    return {"kind": kind, "rank": rank, "block": block, "damping": damping, "power": power, "factor": factor}


def _side_label(sd: dict | None) -> str:
    if sd is None:
        return "-"
    k = sd["kind"]
    what = {
        "lowrank": f"r{sd['rank']}",
        "full": "full",
        "diag": "diag",
        "block": f"block{sd['block']}",
        "sketch": f"r{sd['rank']} sketch{sd['block']}",
    }[k]
    pw = sd["power"]
    extra = (f" p-{pw}" if isinstance(pw, str) else f" p{pw:g}") if pw != 0.5 else ""
    extra += " gram" if sd["factor"] == "gram" else ""
    return f"{what} d{sd['damping']:g}{extra}"


@dataclass(frozen=True)
class GeoRows:
    """Which ablation rows :func:`geo_rows` lists.

    ``rank`` / ``damping``: the GeoFP8 transform the coordinate, staleness and power rows use; ``lowranks``,
    ``blocks``, ``dampings``: the factor approximations and the damping sweep; ``staleness``: step offsets k of the
    captures at t + k (rows with the factor of t and of t + k). ``search``: the candidate powers of
    ``geo.power_search`` (rows with ``power="search"``: per layer, the power chosen as the trainer chooses it, from
    the gradients of the factors' capture). ``auto``: rows with ``geo.power=auto`` (p from the capture's refresh
    statistics). ``default``: ``(label, input side)`` of the ``geofp8`` preset (:func:`preset_side`), the row the
    summary reports as ``geo_default``. ``fp8``: the codec of every row not in the NVFP4 group (default E4M3,
    tensor scaling); ``sketch``: columns of the sketched-factor row (None: no such row); ``nvfp4``: the NVFP4 rows;
    ``investigate``: the rows that probe D's exponent and the gradient-Gram factor."""

    rank: int
    damping: float
    lowranks: list[int]
    blocks: list[int]
    dampings: list[float]
    staleness: list[int]
    investigate: bool = True
    search: tuple = ()
    sketch: int | None = 64
    fp8: str = GEO_FP8
    default: tuple[str, dict] | None = None
    auto: bool = True
    nvfp4: bool = True


def geo_rows(spec: GeoRows) -> list[dict]:
    """The ablation rows of ``spec``: ``{"key", "group", "label", "codec", "input", "output" (side dicts or None),
    "capture" (step offset of the gradients), "stats" (offset of the factors), "baseline" (key)}``."""
    rank, damping, fp8, staleness, search = spec.rank, spec.damping, spec.fp8, spec.staleness, spec.search
    blocks, lowranks, dampings, sketch, default = spec.blocks, spec.lowranks, spec.dampings, spec.sketch, spec.default
    geo = _side("lowrank", rank, damping=damping)
    rows = []

    def add(group, label, codec=None, inp=None, out=None, capture=0, stats=0, baseline=None):
        codec = codec or fp8
        key = f"{codec}|in={_side_label(inp)}|out={_side_label(out)}|g{capture}|A{stats}"
        rows.append(
            {
                "key": key,
                "group": group,
                "label": label,
                "codec": codec,
                "input": inp,
                "output": out,
                "capture": capture,
                "stats": stats,
                "baseline": baseline or key,
            }
        )
        return key

    eu = add("coordinates", "Euclidean (baseline)")
    add("coordinates", f"input-side geo r{rank}", inp=geo, baseline=eu)
    add("coordinates", f"output-side geo r{rank}", out=geo, baseline=eu)
    add("coordinates", f"two-sided geo r{rank}", inp=geo, out=geo, baseline=eu)
    add("A approx", "input full (r = d_in)", inp=_side("full", damping=damping), baseline=eu)
    add("A approx", "input diagonal", inp=_side("diag", damping=damping), baseline=eu)
    for b in blocks:
        add("A approx", f"input block-diag {b}", inp=_side("block", block=b, damping=damping), baseline=eu)
    for r in lowranks:
        add("A approx", f"input low-rank {r}", inp=_side("lowrank", r, damping=damping), baseline=eu)
    if sketch:
        add(
            "A approx",
            f"input r{rank} from a sketch (k = {sketch})",
            inp=_side("sketch", rank, block=sketch, damping=damping),
            baseline=eu,
        )
    for dmp in dampings:
        add("damping", f"input r{rank} damping {dmp:g}", inp=_side("lowrank", rank, damping=dmp), baseline=eu)
    eu_at = {}
    for k in staleness:
        e = eu_at[k] = add("staleness", f"Euclidean @ t+{k}", capture=k, stats=k)
        add("staleness", f"input r{rank}, A fresh @ t+{k}", inp=geo, capture=k, stats=k, baseline=e)
        add("staleness", f"input r{rank}, A stale (t) @ t+{k}", inp=geo, capture=k, stats=0, baseline=e)
    if search:
        ps = _side("lowrank", rank, damping=damping, power="search")
        lab = f"input r{rank}, geo.power_search={','.join(f'{p:g}' for p in search)}"
        add("power search", lab, inp=ps, baseline=eu)
        for k in staleness:
            add("power search", f"{lab}, chosen at t @ t+{k}", inp=ps, capture=k, stats=0, baseline=eu_at[k])
    if spec.auto:
        pa = _side("lowrank", rank, damping=damping, power="auto")
        add("power auto", f"input r{rank}, geo.power=auto", inp=pa, baseline=eu)
        for k in staleness:
            add(
                "power auto",
                f"input r{rank}, geo.power=auto, chosen at t @ t+{k}",
                inp=pa,
                capture=k,
                stats=0,
                baseline=eu_at[k],
            )
    if default is not None:
        add("default", f"geofp8 default ({default[0]})", inp=default[1], baseline=eu)
        for k in staleness:
            add("default", f"geofp8 default, built at t @ t+{k}", inp=default[1], capture=k, stats=0, baseline=eu_at[k])
    if not spec.nvfp4:
        return rows
    e4 = add("nvfp4", "NVFP4 Euclidean", codec=GEO_FP4)
    add("nvfp4", f"NVFP4 input-side geo r{rank}", codec=GEO_FP4, inp=geo, baseline=e4)
    if search:
        add(
            "nvfp4",
            f"NVFP4 input r{rank}, power search",
            codec=GEO_FP4,
            inp=_side("lowrank", rank, damping=damping, power="search"),
            baseline=e4,
        )
    if spec.investigate:
        # why (docs/geofp8_fidelity.md): D's exponent, and a factor that measures the gradient's own energy
        add(
            "investigate",
            f"input r{rank}, D power 1/4",
            inp=_side("lowrank", rank, damping=damping, power=0.25),
            baseline=eu,
        )
        add("investigate", "input full, D power 1/4", inp=_side("full", damping=damping, power=0.25), baseline=eu)
        add(
            "investigate",
            f"input r{rank}, grad Gram, power 1/4",
            inp=_side("lowrank", rank, damping=damping, power=0.25, factor="gram"),
            baseline=eu,
        )
        add(
            "investigate",
            f"NVFP4 input r{rank}, D power 1/4",
            codec=GEO_FP4,
            inp=_side("lowrank", rank, damping=damping, power=0.25),
            baseline=e4,
        )
    # the same configuration listed in two groups is computed once (the rows share the key)
    return rows


class _Transforms:
    """Cache of coordinate transforms per (capture, side, layer, spec)."""

    def __init__(self, caps: dict, output_factor: str, search: tuple = ()):
        self.caps, self.output_factor, self.cache = caps, output_factor, {}
        self.search, self.chosen, self.auto_chosen = tuple(search), {}, {}
        self.seconds = 0.0

    def factor(self, offset: int, side: str, name: str, kind: str = "kfac") -> torch.Tensor:
        cap = self.caps[offset]
        if side == "input" and kind == "gram":
            key = (offset, "gram", name)
            if key not in self.cache:
                self.cache[key] = input_gram_from_grads(cap.grads[name])
            return self.cache[key]
        if side == "input":
            return cap.A[name]
        if self.output_factor == "hooks":
            return cap.S_hooks[name]
        key = (offset, "S", name)
        if key not in self.cache:
            self.cache[key] = output_factor_from_grads(cap.grads[name])
        return self.cache[key]

    def get(self, offset: int, side: str, name: str, sd: dict | None, codec=None):
        if sd is None:
            return None
        key = (offset, side, name, sd["kind"], sd["rank"], sd["block"], sd["damping"], sd["power"], sd["factor"])
        if sd["power"] == "search":
            key += (codec_label(codec),)
        if key not in self.cache:
            t0 = time.perf_counter()
            if sd["power"] == "search":
                self.cache[key] = self._searched(offset, name, sd, codec)
            elif sd["power"] == "auto":
                self.cache[key] = self._auto(offset, name, sd)
            else:
                self.cache[key] = build_coordinate_transform(
                    self.factor(offset, side, name, sd["factor"]),
                    sd["kind"],
                    sd["rank"] or 0,
                    sd["damping"],
                    sd["block"] or 128,
                    sd["power"],
                    sketch_size=sd["block"] or 64,
                    seed=zlib.crc32(name.encode()),
                )
            self.seconds += time.perf_counter() - t0
        return self.cache[key]

    def _searched(self, offset: int, name: str, sd: dict, codec):
        """The trainer's ``geo.power_search`` choice for one layer: the power-1 transform of A, each
        candidate's round-trip error summed over the capture's ranks, the smallest wins."""
        base = build_coordinate_transform(
            self.factor(offset, "input", name), "lowrank", sd["rank"] or 0, sd["damping"], power=1.0
        )
        errs = sum(
            roundtrip_errors(g, base, list(self.search), lambda x: quantize_roundtrip(x, codec))
            for g in self.caps[offset].grads[name]
        )
        p = pick_powers(errs.view(1, -1), list(self.search))[0]
        self.chosen.setdefault((offset, codec_label(codec)), {})[name] = p
        return with_power(base, p)

    def _auto(self, offset: int, name: str, sd: dict):
        """The trainer's ``geo.power=auto`` choice for one layer (:mod:`megatron_geo.geometry.refresh_stats`):
        p = clip(s / 4, 0, 1/2) from the energies of the capture's rank gradients along A's top eigenvectors,
        and p = 0 when the relative-precision model predicts a gain below ``MIN_AUTO_GAIN`` for it."""
        base = build_coordinate_transform(
            self.factor(offset, "input", name), "lowrank", sd["rank"] or 0, sd["damping"], power=1.0
        )
        r = base.U.shape[1]
        mom = sum(RS.layer_moments(g, base.U) for g in self.caps[offset].grads[name])
        p = float(RS.auto_power(RS.energy_slope(mom[:r], mom[r], base.d, base.d_in)))
        t = with_power(base, p)
        if p > 0 and float(RS.relative_gain(self.caps[offset].grads[name], t)) < RS.MIN_AUTO_GAIN:
            p, t = 0.0, with_power(base, 0.0)  # as the trainer: predicted to gain nothing, stays Euclidean
        self.auto_chosen.setdefault(offset, {})[name] = p
        return t


def _aggregate(names: list[str], per_layer: dict, hats: dict, grads: dict) -> dict:
    """Overall metrics of a scope (concatenated layers), as :func:`evaluate_codec` reports them."""
    ranks = len(grads[names[0]])
    cat = [torch.cat([grads[n][r].reshape(-1) for n in names]) for r in range(ranks)]
    o = fidelity_metrics(torch.cat([hats[n].reshape(-1) for n in names]), cat, None, directions=False)
    for k in (
        "dir_err_top",
        "dir_err_tail",
        "n_directions",
        "saturation",
        "underflow",
        "saturated",
        "elements",
        "underflow_count",
        "nonzero",
    ):
        o.pop(k)
    ls = [per_layer[n] for n in names]
    sat, el = sum(x["saturated"] for x in ls), sum(x["elements"] for x in ls)
    und, nz = sum(x["underflow_count"] for x in ls), sum(x["nonzero"] for x in ls)
    o.update(
        saturation=sat / el if el else 0.0,
        underflow=und / nz if nz else 0.0,
        mean_layer_rel_l2=finite_mean([x["rel_l2"] for x in ls]),
        mean_layer_dir_err_top=finite_mean([x["dir_err_top"] for x in ls]),
        mean_layer_dir_err_tail=finite_mean([x["dir_err_tail"] for x in ls]),
    )
    return o


def evaluate_geo_row(
    row: dict,
    caps: dict,
    tf: _Transforms,
    scopes: dict,
    directions: bool,
    fp64: bool,
    collective: tuple = ("fp32", True),
) -> dict:
    """Per-layer metrics of one row on every linear weight, and the overall metrics of each scope.
    ``collective``: ``(name, prediv)`` of the reduce (:func:`~megatron_geo.analysis.fidelity.geo_reduce_and_metrics`;
    NVFP4 rows always use the FP32 sum)."""
    cap = caps[row["capture"]]
    per_layer, hats = {}, {}
    for n in cap.names:
        t_in = tf.get(row["stats"], "input", n, row["input"], row["codec"])
        t_out = tf.get(row["stats"], "output", n, row["output"])
        coll = collective if row["codec"] != GEO_FP4 else ("fp32", True)
        hats[n], per_layer[n] = geo_reduce_and_metrics(
            cap.grads[n],
            row["codec"],
            t_in,
            t_out,
            directions=directions,
            fp64=fp64,
            collective=coll[0],
            prediv=coll[1],
        )
    out = {scope: _aggregate(names, per_layer, hats, cap.grads) for scope, names in scopes.items()}
    out["layers"] = [{"name": n, "shape": list(hats[n].shape), **per_layer[n]} for n in cap.names]
    return out


def _energy_fraction(g: torch.Tensor, U: torch.Tensor) -> float:
    gd = g.double()
    return float((gd @ U.double()).norm() ** 2 / gd.norm() ** 2) if gd.norm() > 0 else 0.0


def refresh_diagnostics(A: torch.Tensor, grads: list, rank: int, damping: float, fp8: str = GEO_FP8) -> dict:
    """The trainer's refresh diagnostics (:mod:`megatron_geo.geometry.refresh_stats`, as ``GeoState`` logs
    them) of one layer from its factor ``A`` and R rank gradients: ``slope``, ``auto_power``, ``ipr``,
    ``cancel`` (top-r subspace), ``pred_gain`` / ``pred_gain_white`` (relative-precision / white-noise model at the
    auto power), and the bound hits
    ``sat`` / ``flush`` of the Euclidean wire (summed over ranks) under ``fp8``'s format."""
    base = build_coordinate_transform(A, "lowrank", rank, damping, power=1.0)
    r, d_in = base.U.shape[1], base.d_in
    mom = sum(RS.layer_moments(g, base.U) for g in grads)
    e, total, gu = mom[:r], mom[r], mom[r + 1 :].view(-1, r)
    s = RS.energy_slope(e, total, base.d, d_in)
    p = float(RS.auto_power(s))
    wire = get_format(parse_codec(fp8)["dtype"])
    fmax, under = wire.fp8_max, wire.underflow_below
    hits = sum(RS.wire_bound_hits(g, fmax, under) for g in grads)
    t = with_power(base, p)
    col = sum(t.apply(g.float()).double().pow(2).sum(0) for g in grads)
    return {
        "slope": float(s),
        "auto_power": p,
        "ipr": float(RS.eigvec_ipr(base.U, base.d)),
        "cancel": float(RS.cancellation(e, gu, len(grads))),
        "pred_gain": 1.0 - float(RS.relative_ratio(col, t.U, t.d, total)) if p > 0 else 0.0,
        "pred_gain_white": 1.0 - float(RS.predicted_ratio(e, total, base.d.double() ** p, d_in)),
        "sat": float(hits[0] / hits[3]),
        "flush": float(hits[1] / hits[2].clamp(min=1)),
    }


def geo_diagnostics(cap: Capture, names: list[str], rank: int, damping: float, fp8: str = GEO_FP8) -> list[dict]:
    """Why the input-side transform helps or not, per layer (capture at t): the spectrum of A, the share
    of the gradient's energy in A's top input directions, the cancellation between ranks, a white-noise
    model of the RelL2 ratio, and the one-rank round trip (quantize + dequantize one gradient)."""
    out = []
    for n in names:
        A, gs = cap.A[n].double(), cap.grads[n]
        ev = torch.linalg.eigvalsh(0.5 * (A + A.T)).flip(0).clamp(min=0)
        tr = float(ev.sum())
        g = torch.stack([x.double() for x in gs]).mean(0)
        t = build_coordinate_transform(cap.A[n], "lowrank", rank, damping)
        U = t.U[:, :rank]
        # white-noise model: per-element relative FP8 error -> error energy ~ c * ||wire||^2, spread evenly
        # over the d_in input directions in wire coordinates; mapping back scales direction i by 1 / d_i.
        wire_e = sum(float(t.apply(x).double().norm() ** 2) for x in gs)
        raw_e = sum(float(x.double().norm() ** 2) for x in gs)
        d = t.d.double()
        inv2 = (float((1.0 / d**2).sum()) + (t.d_in - d.numel())) / t.d_in
        model_ratio = math.sqrt(wire_e / raw_e * inv2) if raw_e > 0 else None
        # the model's optimum over all D of a rank-r transform in A's eigenbasis (Cauchy-Schwarz):
        # ratio^2 >= (sum_{i<=r} sqrt(e_i) + sqrt(e_rest (d_in - r)))^2 / (d_in E), e_i = sum_r ||G_r u_i||^2
        V = torch.linalg.eigh(0.5 * (A + A.T))[1].flip(1)
        e = sum(((x.double() @ V) ** 2).sum(0) for x in gs)
        E, din = float(e.sum()), A.shape[0]
        rr = min(rank, din)
        best_r = (
            (float(e[:rr].sqrt().sum()) + math.sqrt(float(e[rr:].sum()) * (din - rr))) ** 2 / (din * E) if E else None
        )
        best_full = float(e.sqrt().sum()) ** 2 / (din * E) if E else None
        rs = refresh_diagnostics(cap.A[n], gs, rank, damping, fp8)
        rt_e = fidelity_metrics(simulate_reduce(gs[:1], fp8), gs[:1], None, directions=False)["rel_l2"]
        rt_g = geo_reduce_and_metrics(gs[:1], fp8, t, None, directions=False)[1]["rel_l2"]
        out.append(
            {
                "name": n,
                "shape": list(gs[0].shape),
                "d_in": int(A.shape[0]),
                "a_top8_trace_frac": float(ev[:8].sum()) / tr if tr else None,
                "a_top16_trace_frac": float(ev[:16].sum()) / tr if tr else None,
                "a_topr_trace_frac": float(ev[:rank].sum()) / tr if tr else None,
                "a_participation_rank": tr**2 / float((ev**2).sum()) if tr else None,
                "a_lambda1_over_mean": float(ev[0]) / (tr / ev.numel()) if tr else None,
                "a_lambda_r_over_ref": (
                    float(ev[min(rank, ev.numel()) - 1] / ev[rank:].mean()) if ev.numel() > rank else None
                ),
                "d_min": float(t.d.min()) if t.d.numel() else None,
                "grad_energy_topr": _energy_fraction(g, U),
                "rank_grad_energy_topr": finite_mean([_energy_fraction(x, U) for x in gs]),
                "rank_cancellation": math.sqrt(raw_e / len(gs)) / float(g.norm()) if float(g.norm()) > 0 else None,
                "wire_energy_ratio": wire_e / raw_e if raw_e > 0 else None,
                "model_rel_l2_ratio": model_ratio,
                "model_best_ratio_r": math.sqrt(best_r) if best_r is not None else None,
                "model_best_ratio_full": math.sqrt(best_full) if best_full is not None else None,
                "rank_grad_energy_topr_sum": float(e[:rr].sum()) / E if E else None,
                "roundtrip_rel_l2_euclid": rt_e,
                "roundtrip_rel_l2_geo": rt_g,
                **rs,
            }
        )
    return out


def _targets(rows: list[dict]) -> dict:
    """The fidelity targets on the selected layers: the preset default's RelL2 reduction vs Euclidean at t (>=
    :data:`TARGET_REDUCTION_PCT`) and at each staleness capture (never below 0: never worse than Euclidean).
    Without a default row, the input-side r row (rows[1])."""
    default = [x for x in rows if x["group"] == "default"] or [rows[1]]
    now = next(x for x in default if x["capture"] == 0)
    red = now["selected"].get("rel_l2_reduction_pct")
    stale = {str(x["capture"]): x["selected"].get("rel_l2_reduction_pct") for x in default if x["capture"]}
    return {
        "row": now["label"],
        "rel_l2_reduction_pct": red,
        "target_reduction_pct": TARGET_REDUCTION_PCT,
        "paper_reduction_pct": PAPER_REDUCTION_PCT,
        "reduction_met": red is not None and red >= TARGET_REDUCTION_PCT,
        "staleness_reduction_pct": stale,
        "staleness_never_worse": all(v is not None and v >= 0 for v in stale.values()) if stale else None,
    }


def _add_relative(rows: list[dict]) -> None:
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        b = by_key[r["baseline"]]
        for scope in ("selected", "all_linear"):
            o, ob = r[scope], b[scope]
            o["rel_l2_reduction_pct"] = (
                100.0 * (1.0 - o["rel_l2"] / ob["rel_l2"]) if o["rel_l2"] is not None and ob["rel_l2"] else None
            )
            o["mean_layer_rel_l2_reduction_pct"] = (
                100.0 * (1.0 - o["mean_layer_rel_l2"] / ob["mean_layer_rel_l2"])
                if o["mean_layer_rel_l2"] is not None and ob["mean_layer_rel_l2"]
                else None
            )
            t, tb = o["mean_layer_dir_err_tail"], ob["mean_layer_dir_err_tail"]
            o["tail_ratio"] = tb / t if t and tb is not None else None
            t, tb = o["mean_layer_dir_err_top"], ob["mean_layer_dir_err_top"]
            o["top_ratio"] = tb / t if t and tb is not None else None


def check_geo_fp8_codec(spec: str) -> str:
    """``--geo-fp8-codec``: an FP8 codec the trainer also accepts (E4M3/E5M2, tensor scaling or a
    power-of-two block, no rotation); returns its canonical label.

    Raises:
        ValueError: anything else, naming the value and the accepted forms.
    """
    c = parse_codec(spec)
    ok = (
        c["dtype"] in fp8_formats()
        and c["transform"] == "none"
        and (c["scaling"] == "tensor" or is_pow2(c["block_size"]))
    )
    if not ok:
        raise ValueError(
            f"--geo-fp8-codec={spec!r}: the FP8 rows need {' or '.join(fp8_formats())} with tensor "
            f"scaling or a power-of-two block and no rotation, e.g. fp8_e5m2:tensor or fp8_e4m3:block128 "
            f"(NVFP4 has its own rows)"
        )
    return codec_label(c)


def fp8_formats() -> list[str]:
    """The registered FP8 wire formats (those with an ``fp8_max``): ``["fp8_e4m3", "fp8_e5m2"]`` today."""
    return [n for n, f in FORMATS.items() if f.fp8_max is not None]


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _float_list(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def preset_side(name: str, root: str) -> tuple[str, dict, tuple]:
    """``(label, input side, power_search candidates)`` of the GeoFP8 preset ``configs/comm/<name>.yaml``
    under ``root``: its rank, damping and power (a number, ``auto``, or ``search`` with its candidates).

    Raises:
        ValueError / ConfigError: the preset does not exist or is not a GeoFP8 preset.
    """
    import os

    from ..config import load_config
    from ..config.schema import parse_power, parse_power_search

    path = os.path.join(root, "configs", "comm", f"{name}.yaml")
    if not os.path.exists(path):
        raise ValueError(f"preset {name!r} not found ({os.path.join('configs', 'comm', name + '.yaml')})")
    cfg = load_config([path], [])
    if cfg.comm.transform != "geo":
        raise ValueError(f"preset {name!r} is not a GeoFP8 preset (comm.transform={cfg.comm.transform})")
    if cfg.comm.dtype not in fp8_formats():
        raise ValueError(
            f"preset {name!r} sends {cfg.comm.dtype}; --preset takes an FP8 GeoFP8 preset (geofp8, "
            f"geofp8_search, geofp8_paper): its rows use --geo-fp8-codec (the model mode's NVFP4 rows "
            f"cover GeoNVFP4)"
        )
    g = cfg.geo
    search = parse_power_search(g.power_search)
    power = "search" if search else parse_power(g.power)
    label = f"{name}: r{g.rank}, p={power if isinstance(power, str) else format(power, 'g')}"
    return label, _side("lowrank", g.rank, damping=g.damping, power=power), search


@dataclass(frozen=True)
class GeoEval:
    """How :func:`run_geo` evaluates the rows: ``output_factor`` (``grads`` or ``hooks``: where the output-side
    factor comes from), ``directions`` (the direction metrics), ``fp64`` (transforms built in FP64), ``rank`` /
    ``damping`` / ``fp8`` (the per-layer diagnostics' transform and codec), ``quiet`` (no line per row) and
    ``collective`` (``(reduce_op, wire_sum_prediv)`` of the simulated reduction)."""

    output_factor: str = "grads"
    directions: bool = True
    fp64: bool = True
    rank: int = 32
    damping: float = 1e-3
    fp8: str = GEO_FP8
    quiet: bool = False
    collective: tuple = ("fp32", True)


def run_geo(caps: dict, scopes: dict, rows: list[dict], search: tuple, ev: GeoEval = GeoEval()) -> dict:
    """Evaluate every row (:func:`geo_rows`) on the captures ``caps`` (``{step offset: Capture}``; offset 0
    is the capture at t) for each scope (``{"selected": names, "all_linear": names}``) as ``ev`` says, add the
    reductions against each row's baseline, and the per-layer diagnostics of the selected layers at t. Returns the
    ``geo`` JSON section (without ``settings``)."""
    output_factor, directions, fp64, collective = ev.output_factor, ev.directions, ev.fp64, ev.collective
    timings = {}
    tf = _Transforms(caps, output_factor, search)
    done, t_eval = {}, time.perf_counter()
    for r in rows:
        if r["key"] not in done:
            ts = time.perf_counter()
            done[r["key"]] = evaluate_geo_row(r, caps, tf, scopes, directions, fp64, collective)
            if not ev.quiet:
                print(
                    f"  {r['group']:<12} {r['label']:<36} RelL2(selected) "
                    f"{done[r['key']]['selected']['rel_l2']:.3e}  ({time.perf_counter() - ts:.1f} s)",
                    flush=True,
                )
        r.update(done[r["key"]])
    timings["evaluate_s"] = time.perf_counter() - t_eval
    timings["build_transforms_s"] = tf.seconds
    _add_relative(rows)
    ts = time.perf_counter()
    diag = geo_diagnostics(caps[0], scopes["selected"], ev.rank, ev.damping, ev.fp8)
    timings["diagnostics_s"] = time.perf_counter() - ts
    lay_e = {x["name"]: x["rel_l2"] for x in rows[0]["layers"]}
    lay_g = {x["name"]: x["rel_l2"] for x in rows[1]["layers"]}
    for x in diag:
        x["measured_rel_l2_ratio"] = lay_g[x["name"]] / lay_e[x["name"]] if lay_e[x["name"]] else None
    return {
        "capture_steps": {str(k): c.step for k, c in caps.items()},
        "capture_losses": {str(k): c.loss for k, c in caps.items()},
        "power_search_choices": {f"A@t+{k[0]} {k[1]}": v for k, v in tf.chosen.items()},
        "power_auto_choices": {f"A@t+{k}": v for k, v in tf.auto_chosen.items()},
        "selected_layers": scopes["selected"],
        "rows": rows,
        "targets": _targets(rows),
        "diagnostics": diag,
        "timings": timings,
    }
