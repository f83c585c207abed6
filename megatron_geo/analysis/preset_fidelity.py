"""Every comm preset's one-step fidelity on a model's real gradients, per layer kind and over the whole gradient
(``tools/grad_fidelity.py --presets``), with the question of which layers GeoFP8 should transform, the K-FAC
input factor's spectrum per layer kind and the model's massive activations.

What is simulated (docs/design.md section 4): R consecutive micro-batches stand in for R DP ranks; every
parameter's R gradients go through the preset's codec as :func:`~megatron_geo.analysis.fidelity.simulate_reduce`
does (per-rank scales, FP32 sum, one division by R; ``transform=hadamard`` rotates 128-element blocks), and a
GeoFP8-selected weight through :func:`~megatron_geo.analysis.fidelity.simulate_geo_reduce` with the preset's
input-side transform built from the same micro-batches' DP-summed K-FAC factor A = E[a a^T] (rank, damping,
power: a number, or ``auto``, the trainer's own slope rule). This is one step from zero residual, so error
feedback (on in the GeoFP8 presets) does not enter. RelL2 = ||g^ - g|| / ||g||, g the FP64 average.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import fnmatch
import math
import time

import torch

from ..comm.roundtrip import CODEC_DEFAULTS, codec_label
from ..config.presets import comm_presets, preset_config
from ..config.schema import parse_power
from ..geometry import InputStats
from ..training.step import autocast_context
from .capture import Capture
from .fidelity import simulate_geo_reduce, simulate_reduce
from .geo_ablation import _side, _Transforms

# the layer kinds of a Llama, by the end of the parameter name
KINDS = {
    "q": "attn.q_proj.weight",
    "k": "attn.k_proj.weight",
    "v": "attn.v_proj.weight",
    "o": "attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "embedding": "embed.weight",
    "output": "output.weight",
    "norm": "norm.weight",
}
# GeoFP8 candidates: every linear weight kind; the inputs of q/k/v (and of gate/up) are one RMSNorm output
LINEAR_KINDS = ("q", "k", "v", "o", "gate", "up", "down", "output")
KIND_GLOBS = {k: ("output.weight" if k == "output" else f"layers.*.{KINDS[k]}") for k in LINEAR_KINDS}
DEFAULT_PRESETS = (
    "fp8",
    "fp8_e5m2",
    "fp8_block",
    "fp8_hadamard",
    "geofp8",
    "geofp8_tensor",
    "geofp8_paper",
    "bf16",
    "nvfp4",
    "geonvfp4",
)
REFERENCE = "fp8"  # Euclidean FP8: E4M3, one scale per parameter (the paper's baseline)


def kind_of(name: str) -> str:
    """The layer kind of a parameter name (``layers.3.mlp.down_proj.weight`` -> ``down``)."""
    for k, suffix in KINDS.items():
        if name == suffix or name.endswith("." + suffix):
            return k
    return "other"


def preset_plan(name: str) -> dict:
    """``{codec, geo: None | {layers, rank, damping, power}}`` of ``configs/comm/<name>.yaml``.

    Raises:
        ValueError: no such preset; a preset whose geo.power_search needs trial quantisation, or whose scales
            are shared (``comm.scale_sync=max``) or codes summed in FP8 (``comm.reduce_op=wire_sum``): not
            simulated here.
        ConfigError: the preset's ``geo.power`` is not ``auto`` or a number in (0, 1] (:func:`parse_power`).
    """
    cfg = preset_config(name)
    comm = cfg.comm
    if comm.scale_sync != "none" or comm.reduce_op != "fp32_sum":
        raise ValueError(
            f"preset {name!r} shares its scales or sums codes in the wire format; this report simulates per-rank "
            f"scales and an FP32 sum only (tools/grad_fidelity.py --geo --collective wire_sum covers the latter)"
        )
    codec = {k: getattr(comm, k) for k in CODEC_DEFAULTS if hasattr(comm, k)}
    geo = None
    if comm.transform == "geo":
        codec["transform"] = "none"
        if cfg.geo.power_search:
            raise ValueError(f"preset {name!r} chooses its power by trial quantisation; use --geo for it")
        geo = {
            "layers": cfg.geo.layers,
            "rank": cfg.geo.rank,
            "damping": cfg.geo.damping,
            "power": parse_power(cfg.geo.power),
        }
    return {"codec": codec, "geo": geo}


def _matches(name: str, patterns: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p.strip()) for p in patterns.split(",") if p.strip())


class _Activations:
    """Forward hooks on every block: the largest |value| of its output (the residual stream) and that
    value's channel and token position, against the median |value|; run once on one micro-batch."""

    def __init__(self, model):
        self.rows: list[dict] = []
        self.handles = [b.register_forward_hook(self._hook(i)) for i, b in enumerate(model.layers)]

    def _hook(self, i):
        def hook(module, args, out):
            x = out.detach().float()[0]  # [s, h] of the first sequence
            a = x.abs()
            flat = int(a.argmax())
            tok, ch = divmod(flat, a.shape[1])
            self.rows.append(
                {
                    "layer": i,
                    "max_abs": float(a.max()),
                    "median_abs": float(a.median()),
                    "channel": ch,
                    "token": tok,
                }
            )

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def capture_all(sess, ranks: int) -> tuple[Capture, dict[str, list[torch.Tensor]], list[dict]]:
    """Per-rank gradients of every parameter (rank r's micro-batch: global samples ``consumed + r * m`` ..),
    the K-FAC input factor of every linear weight over the same micro-batches, and the residual stream's
    largest values (first micro-batch).

    Returns ``(capture of the linear weights, {name: [R float32 gradients]} of every parameter, activations)``.
    """
    from .model_capture import linear_weights

    cfg, pctx, model = sess.cfg, sess.pctx, sess.model
    mods = dict(model.named_modules())
    linear = [n for n, _ in linear_weights(model)]
    stats = InputStats({n: mods[n[: -len(".weight")]] for n in linear})
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
    m, losses, acts = cfg.train.micro_batch_size, [], None
    t0 = time.perf_counter()
    stats.arm()
    try:
        for r in range(ranks):
            start = sess.consumed + r * m
            mb = sess.data.train.micro_batch(list(range(start, start + m)))
            tokens, labels, mask = (mb[k].to(pctx.device) for k in ("tokens", "labels", "loss_mask"))
            watch = _Activations(model) if r == 0 else None
            with autocast_context(pctx, cfg.train.autocast_dtype):
                per_token = model(tokens, labels)
            if watch is not None:
                watch.remove()
                acts = watch.rows
            loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
            for (n, _), g in zip(named, torch.autograd.grad(loss, [p for _, p in named])):
                g = g.detach().float()
                if n in ("embed.weight", "output.weight"):
                    g = g[: cfg.model.vocab_size]  # the vocab padding rows carry no gradient
                grads[n].append(g)
            losses.append(float(loss.detach()))
    finally:
        stats.disarm()
    A = {n: a.cpu() for n, a in stats.reduce(pctx.dp_group).items()}
    cap = Capture(
        sess.step, linear, {n: grads[n] for n in linear}, sum(losses) / len(losses), A, None, time.perf_counter() - t0
    )
    return cap, grads, acts or []


def _rel(err2: float, ref2: float) -> float:
    return math.sqrt(err2 / ref2) if ref2 > 0 else float("nan")


def _reduce_all(grads: dict, plan: dict, tf: _Transforms, geo_names: set) -> dict[str, tuple[float, float]]:
    """``{name: (||g^ - g||^2, ||g||^2)}`` in FP64 for every parameter under one plan."""
    out = {}
    for n, gs in grads.items():
        g = torch.stack([x.double() for x in gs]).mean(0)
        if n in geo_names:
            t_in = tf.get(
                0,
                "input",
                n,
                _side("lowrank", plan["geo"]["rank"], damping=plan["geo"]["damping"], power=plan["geo"]["power"]),
            )
            g_hat = simulate_geo_reduce(gs, plan["codec"], t_in, None)
        else:
            g_hat = simulate_reduce(gs, plan["codec"])
        out[n] = (float((g_hat.double() - g).square().sum()), float(g.square().sum()))
    return out


def _groups(errs: dict, names_by_group: dict[str, list[str]]) -> dict[str, float]:
    return {
        grp: _rel(sum(errs[n][0] for n in names), sum(errs[n][1] for n in names))
        for grp, names in names_by_group.items()
        if names
    }


def _pct(x: float, ref: float) -> float:
    return 100.0 * (x / ref - 1.0) if ref and math.isfinite(x) and math.isfinite(ref) else float("nan")


def spectrum_report(A: dict[str, torch.Tensor], rank: int = 32) -> dict:
    """Per layer kind (medians over its layers) of the K-FAC input factor's eigenvalues (FP64 ``eigh``):
    ``top_over_median`` (lambda_1 / median lambda), ``rank_energy`` (share of trace(A) in the top ``rank``
    eigenvalues: what a rank-``rank`` factor keeps exactly), ``effective_rank`` (participation ratio
    (sum lambda)^2 / sum lambda^2), ``channel_max_over_median`` (largest input channel RMS sqrt(A_ii) over the
    median channel RMS: outlier input channels)."""
    per_kind: dict[str, list[dict]] = {}
    for n, a in A.items():
        ev = torch.linalg.eigvalsh(a.double()).clamp(min=0).flip(0)
        rms = a.double().diagonal().clamp(min=0).sqrt()
        per_kind.setdefault(kind_of(n), []).append(
            {
                "d_in": a.shape[0],
                "top_over_median": float(ev[0] / ev.median().clamp(min=1e-300)),
                "rank_energy": float(ev[:rank].sum() / ev.sum()),
                "effective_rank": float(ev.sum() ** 2 / ev.square().sum()),
                "channel_max_over_median": float(rms.max() / rms.median().clamp(min=1e-300)),
            }
        )
    out = {}
    for k, rows in per_kind.items():
        out[k] = {"layers": len(rows), "d_in": rows[0]["d_in"]}
        for key in ("top_over_median", "rank_energy", "effective_rank", "channel_max_over_median"):
            vals = sorted(r[key] for r in rows)
            out[k][key] = {"median": vals[len(vals) // 2], "min": vals[0], "max": vals[-1]}
    return out


def run_presets(sess, ranks: int, presets: list[str], candidates: bool = True, log=print) -> dict:
    """The ``--presets`` report (module docstring): ``{summary, presets {name: {plan, groups, change_pct}},
    layer_choice (with ``candidates``), spectrum, activations, capture}``. ``summary[name]`` holds the RelL2
    change vs Euclidean FP8 over the whole gradient (``whole_change_pct``) and over the layers the preset
    transforms (``transformed_change_pct``; None for a preset without a learned transform)."""
    t0 = time.perf_counter()
    cap, grads, acts = capture_all(sess, ranks)
    log(f"captured {ranks} ranks x {len(grads)} parameters, loss {cap.loss:.4f} ({time.perf_counter() - t0:.1f} s)")
    names = list(grads)
    by_kind: dict[str, list[str]] = {}
    for n in names:
        by_kind.setdefault(kind_of(n), []).append(n)
    tf = _Transforms({0: cap}, "grads")
    plans = {p: preset_plan(p) for p in dict.fromkeys([REFERENCE, *presets])}
    results, errs_of = {}, {}
    transformed = {
        p: sorted(n for n in cap.names if plan["geo"] and _matches(n, plan["geo"]["layers"]))
        for p, plan in plans.items()
    }
    for p, plan in plans.items():
        ts = time.perf_counter()
        geo_names = transformed[p]
        errs = _reduce_all(grads, plan, tf, set(geo_names))
        errs_of[p] = errs
        groups = {"whole": _groups(errs, {"whole": names})["whole"], **_groups(errs, by_kind)}
        if geo_names:
            groups["transformed"] = _groups(errs, {"t": geo_names})["t"]
        results[p] = {
            "plan": {"codec": codec_label(plan["codec"]), "geo": plan["geo"]},
            "transformed_layers": len(geo_names),
            "rel_l2": groups,
        }
        log(f"  {p:14s} whole-gradient RelL2 {groups['whole']:.4e} ({time.perf_counter() - ts:.1f} s)")
    ref = results[REFERENCE]["rel_l2"]
    summary = {}
    for p, r in results.items():
        r["change_pct"] = {g: _pct(v, ref[g]) for g, v in r["rel_l2"].items() if g in ref}
        if transformed[p]:  # against Euclidean FP8 on the same layers
            fp8_on_those = _groups(errs_of[REFERENCE], {"t": transformed[p]})["t"]
            r["change_pct"]["transformed"] = _pct(r["rel_l2"]["transformed"], fp8_on_those)
        summary[p] = {
            "whole_rel_l2": r["rel_l2"]["whole"],
            "whole_change_pct": r["change_pct"]["whole"],
            "transformed_change_pct": r["change_pct"].get("transformed"),
        }
    out = {"summary": summary, "reference": REFERENCE, "presets": results}
    if candidates:
        out["layer_choice"] = layer_choice(cap, grads, tf, errs_of[REFERENCE], log)
    out["spectrum"] = spectrum_report(cap.A)
    out["activations"] = acts
    out["auto_powers"] = {n: p for n, p in tf.auto_chosen.get(0, {}).items()}
    out["capture"] = {"ranks": ranks, "loss": cap.loss, "step": cap.step, "seconds": cap.seconds}
    out["wall_s"] = time.perf_counter() - t0
    return out


def layer_choice(cap: Capture, grads: dict, tf: _Transforms, fp8_errs: dict, log=print) -> dict:
    """GeoFP8 (``geofp8_tensor``: rank 32, damping, ``power=auto``; E4M3, tensor scaling) on each linear kind alone, and
    on sets of kinds: ``{kinds: {kind: {layers, fp8_rel_l2, geo_rel_l2, change_pct, median_power,
    euclidean_layers (auto chose p = 0)}}, sets: {label: {kinds, transformed_change_pct, whole_change_pct}}}``.
    The sets are every linear kind, and the kinds in order of their own gain (best first), each prefix once; a
    set's whole-gradient change counts every other parameter as Euclidean FP8."""
    plan = preset_plan("geofp8_tensor")
    kinds, geo_errs = {}, {}
    for kind, glob in KIND_GLOBS.items():
        layer_names = [n for n in cap.names if fnmatch.fnmatchcase(n, glob)]
        if not layer_names:
            continue
        errs = _reduce_all({n: grads[n] for n in layer_names}, plan, tf, set(layer_names))
        geo_errs.update(errs)
        geo = _groups(errs, {"k": layer_names})["k"]
        fp8 = _groups(fp8_errs, {"k": layer_names})["k"]
        powers = sorted(tf.auto_chosen.get(0, {}).get(n, float("nan")) for n in layer_names)
        kinds[kind] = {
            "layers": len(layer_names),
            "names": layer_names,
            "fp8_rel_l2": fp8,
            "geo_rel_l2": geo,
            "change_pct": _pct(geo, fp8),
            "median_power": powers[len(powers) // 2],
            "euclidean_layers": sum(1 for p in powers if p == 0),
        }
        log(f"  geo on {kind:6s}: RelL2 {fp8:.4e} -> {geo:.4e} ({kinds[kind]['change_pct']:+.1f}%)")
    order = sorted(kinds, key=lambda k: kinds[k]["change_pct"])
    candidates = {"all linear": list(kinds)}
    for i in range(1, len(order) + 1):
        candidates.setdefault("+".join(order[:i]), order[:i])
    sets, names = {}, list(fp8_errs)
    for label, ks in candidates.items():
        chosen = {n for k in ks for n in kinds[k]["names"]}
        mixed = {n: geo_errs[n] if n in chosen else fp8_errs[n] for n in names}
        t = _groups(mixed, {"t": sorted(chosen)})["t"]
        sets[label] = {
            "kinds": ks,
            "layers": len(chosen),
            "transformed_change_pct": _pct(t, _groups(fp8_errs, {"t": sorted(chosen)})["t"]),
            "whole_change_pct": _pct(_groups(mixed, {"w": names})["w"], _groups(fp8_errs, {"w": names})["w"]),
        }
    for k in kinds.values():
        k.pop("names")
    return {"kinds": kinds, "sets": sets}


def all_presets() -> list[str]:
    """The presets this report can simulate: every ``configs/comm`` preset but ``fp32`` (lossless) and those
    :func:`preset_plan` refuses. (``fp8_ef`` equals ``fp8`` in one step from a zero residual.)"""
    names = []
    for n in comm_presets():
        try:
            preset_plan(n)
        except ValueError:
            continue
        if n != "fp32":
            names.append(n)
    return names


def _f(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def preset_report(doc: dict, markdown: bool = False) -> str:
    """The ``--presets`` report as text (aligned columns) or Markdown tables: RelL2 per preset and layer kind,
    the change vs Euclidean FP8, GeoFP8 per layer kind, the K-FAC spectrum and the largest activations."""
    kinds = [k for k in (*KINDS, "transformed", "whole") if any(k in r["rel_l2"] for r in doc["presets"].values())]

    def table(header: list[str], rows: list[list[str]]) -> str:
        if markdown:
            lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
            return "\n".join(lines)
        w = [max(len(x) for x in col) for col in zip(header, *rows)]
        return "\n".join("  ".join(x.rjust(n) for x, n in zip(r, w)) for r in [header, *rows])

    parts = [
        f"One-step RelL2 of the DP-reduced gradient vs its FP64 average, {doc['capture']['ranks']} simulated ranks "
        f"(capture loss {doc['capture']['loss']:.4f}); change vs Euclidean FP8 ({doc['reference']}) in %",
        table(
            ["preset", "codec", *kinds],
            [
                [p, r["plan"]["codec"], *(_f(r["rel_l2"].get(k), ".3e") for k in kinds)]
                for p, r in doc["presets"].items()
            ],
        ),
        table(
            ["preset", *kinds],
            [[p, *(_f(r["change_pct"].get(k), "+.1f") for k in kinds)] for p, r in doc["presets"].items()],
        ),
    ]
    if "layer_choice" in doc:
        parts += [
            "GeoFP8 (geofp8_tensor: rank 32, damping 1e-3, power=auto, tensor scales) on each linear layer kind alone",
            table(
                ["kind", "layers", "fp8 RelL2", "geo RelL2", "change %", "median p", "kept Euclidean"],
                [
                    [
                        k,
                        str(r["layers"]),
                        _f(r["fp8_rel_l2"], ".3e"),
                        _f(r["geo_rel_l2"], ".3e"),
                        _f(r["change_pct"], "+.1f"),
                        _f(r["median_power"], ".3f"),
                        str(r["euclidean_layers"]),
                    ]
                    for k, r in doc["layer_choice"]["kinds"].items()
                ],
            ),
            "GeoFP8 (power=auto) on sets of layer kinds (the others Euclidean FP8): RelL2 change vs Euclidean FP8",
            table(
                ["kinds", "layers", "transformed %", "whole gradient %"],
                [
                    [k, str(r["layers"]), _f(r["transformed_change_pct"], "+.1f"), _f(r["whole_change_pct"], "+.1f")]
                    for k, r in doc["layer_choice"]["sets"].items()
                ],
            ),
        ]
    sp = doc["spectrum"]
    parts += [
        "K-FAC input factor A per layer kind (median over layers [min, max])",
        table(
            ["kind", "d_in", "lambda1/median", "top-32 share of trace", "effective rank", "max/median channel RMS"],
            [
                [
                    k,
                    str(r["d_in"]),
                    *(
                        f"{_f(r[key]['median'], fmt)} [{_f(r[key]['min'], fmt)}, {_f(r[key]['max'], fmt)}]"
                        for key, fmt in (
                            ("top_over_median", ".3g"),
                            ("rank_energy", ".3f"),
                            ("effective_rank", ".1f"),
                            ("channel_max_over_median", ".3g"),
                        )
                    ),
                ]
                for k, r in sp.items()
            ],
        ),
    ]
    acts = doc.get("activations") or []
    if acts:
        top = max(acts, key=lambda a: a["max_abs"])
        parts.append(
            f"Residual stream: largest |value| {top['max_abs']:.4g} after layer {top['layer']} (channel "
            f"{top['channel']}, token {top['token']}), {top['max_abs'] / max(top['median_abs'], 1e-30):.4g}x the "
            f"median |value| of that layer's output; first layer above 100x the median: "
            + str(next((a["layer"] for a in acts if a["max_abs"] > 100 * max(a["median_abs"], 1e-30)), "none"))
        )
    return "\n\n".join(parts)
