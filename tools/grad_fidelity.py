#!/usr/bin/env python
"""Gradient fidelity of low-precision DP reduction codecs on real gradients (DESIGN.md section 4).

1. Trains the model (default ``configs/tiny.yaml``, one process, embedded corpus unless the config says
   otherwise) for ``--warmup-steps`` steps with the config's optimizer and LR schedule, so the gradients
   are those of a model in training rather than at init.
2. Captures per-rank gradients: ``--ranks R`` consecutive micro-batches (``train.micro_batch_size``
   samples each, the samples the next step would use) stand in for R DP ranks; each gets its own
   backward on the same weights (``torch.autograd.grad`` of that micro-batch's mean per-token loss, so
   the exact average over ranks is the gradient of the mean loss over all R micro-batches).
3. Passes every linear weight's R gradients through each codec of ``--codecs`` with
   :func:`megatron_geo.comm.fidelity.simulate_reduce` (per-rank scales, FP32 sum, one division by R) and
   measures :func:`~megatron_geo.comm.fidelity.fidelity_metrics` per layer and overall (overall = the
   metrics of the concatenation of all linear weights, bound-hit counts summed over layers, plus the mean
   of the per-layer RelL2 and per-direction errors).

    python tools/grad_fidelity.py [--config configs/tiny.yaml] [--warmup-steps 100] [--ranks 4]
        [--codecs fp8_e4m3:tensor fp8_e4m3:block128 ...] [--out runs/grad_fidelity.json] [--per-layer]
        [section.key=value ...]

``--geo`` (GeoFP8 ablation mode, instead of the codec table): the K-FAC input factor A = E[a a^T] of
every linear weight is collected with :class:`~megatron_geo.geometry.stats.InputStats` on the same
micro-batches as the gradients and averaged over the simulated ranks (as the trainer all-reduces it over
DP before the eigendecomposition); the output factor is ``sum_r G_r G_r^T / (R d_in)`` (or E[g g^T] of the
output gradients with ``--output-factor hooks``). Every linear weight's R gradients are then reduced with
:func:`~megatron_geo.comm.fidelity.simulate_geo_reduce` (each rank sends T_out^T G_r T_in, quantized with
its own scale, FP32 sum, mapped back with the inverses) under FP8 E4M3 tensor scaling in these
coordinate systems: Euclidean; input-side, output-side and two-sided GeoFP8 (``--geo-rank``,
``--geo-damping`` relative to the mean eigenvalue); input side with A full rank, diagonal, block-diagonal
(``--geo-blocks``) and low rank (``--geo-lowranks``); a damping sweep (``--geo-dampings``); staleness (the
transform built from A at t applied to gradients captured after training on to t + k, ``--geo-staleness``);
NVFP4 Euclidean vs input-side. Reported for the GeoFP8-selected layers (``--geo-layers``) and, with every
layer transformed, for all linear weights, with the issue's targets (RelL2 -60% and a 5x lower tail
per-direction error at r = 32 on the selected layers) and per-layer diagnostics (spectrum of A, share of
the gradient energy in A's top directions, a white-noise model of the gain). ``--markdown FILE`` writes
the report as Markdown; the JSON then has ``"mode": "geo"`` and a ``"geo"`` section (settings,
capture_steps, selected_layers, rows [{key, group, label, codec, input, output, capture, stats, baseline,
selected {overall metrics + rel_l2_reduction_pct, tail_ratio, top_ratio}, all_linear {...}, layers
[...]}], targets, diagnostics, timings).

    python tools/grad_fidelity.py --geo [--geo-layers 'layers.*.mlp.down_proj.weight'] [--geo-rank 32]
        [--geo-damping 1e-3] [--geo-staleness 10,25,50] [--markdown FILE] [--out FILE] [section.key=value ...]

Overrides may also follow ``--codecs`` (any value containing ``=`` is taken as an override).
Codec specs: see megatron_geo/comm/fidelity.py (``fp8_e4m3:tensor``, ``fp8_e4m3:block128``,
``fp8_e4m3:tensor+hadamard128``, ``nvfp4``, ``bf16``, ``fp32``, ``...:stochastic``). The Hadamard
signs use ``train.seed`` as the reducer does, unless the spec names ``seedN``.

JSON (``--out``): ``{"config_files", "overrides", "warmup_steps", "ranks", "micro_batch_size",
"device", "train_loss_first", "train_loss_last", "capture_loss", "layers" [{"name", "shape"}],
"codecs": [{"codec" (spec string), "settings" (full codec dict), "bytes_per_element",
"overall": {rel_l2, mean_layer_rel_l2, sqnr_db, cosine, max_err, norm, saturation, underflow, saturated,
elements, underflow_count, nonzero, mean_layer_dir_err_top, mean_layer_dir_err_tail},
"layers": [{"name", "shape", rel_l2, sqnr_db, cosine, max_err, norm, saturation, underflow, saturated,
elements, underflow_count, nonzero, dir_err_top, dir_err_tail, n_directions}]}], "wall_s"}``.
Non-finite values (e.g. the SQNR of an exact codec) are written as null.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.comm.codecs import bytes_per_element  # noqa: E402
from megatron_geo.comm.fidelity import (  # noqa: E402
    build_coordinate_transform, codec_label, fidelity_metrics, geo_reduce_and_metrics, input_gram_from_grads,
    is_pow2, normalize_codec, output_factor_from_grads, parse_codec, quantize_roundtrip, simulate_reduce)
from megatron_geo.config import ConfigError, load_config, validate_config  # noqa: E402
from megatron_geo.config.validate import parse_power_search  # noqa: E402
from megatron_geo.geometry import InputStats, select_parameters  # noqa: E402
from megatron_geo.geometry.power_search import pick_powers, roundtrip_errors, with_power  # noqa: E402
from megatron_geo.parallel import LaunchEnv, destroy_parallel, init_parallel  # noqa: E402
from megatron_geo.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron_geo.training.data_setup import build_data, train_micro_batches  # noqa: E402
from megatron_geo.training.schedule import lr_at  # noqa: E402
from megatron_geo.training.step import autocast_context, train_step  # noqa: E402
from megatron_geo.training.trainer import build_model_and_optimizer  # noqa: E402

DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "tiny.yaml")
DEFAULT_CODECS = ["fp8_e4m3:tensor", "fp8_e4m3:block128", "fp8_e5m2:tensor", "fp8_e4m3:tensor+hadamard128",
                  "nvfp4", "bf16"]


# -- shared with tools/profile_fp8_vulnerability.py ----------------------------------------------------
@dataclass
class Session:
    """A single-process (world of one) training setup built from a config."""

    cfg: object
    pctx: object
    data: object
    model: torch.nn.Module
    grad_sync: object
    optimizer: object
    consumed: int = 0
    step: int = 0


def open_session(config_files: list[str], overrides: list[str]) -> Session:
    """Load and validate the config (``parallel.tensor`` forced to 1), start a world of one, build data,
    model, gradient path and optimizer exactly as ``pretrain_llama.py`` does.

    Raises:
        ConfigError: bad config or data.
    """
    cfg = load_config(config_files or [DEFAULT_CONFIG], overrides)
    if cfg.parallel.tensor != 1:
        print(f"note: parallel.tensor={cfg.parallel.tensor} -> 1 (these tools run one process)", flush=True)
        cfg.parallel.tensor = 1
    validate_config(cfg, 1)
    pctx = init_parallel(1, cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_minutes,
                         LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    torch.manual_seed(cfg.train.seed)
    data = build_data(cfg, pctx)
    model, _, _, grad_sync, optimizer = build_model_and_optimizer(cfg, pctx)
    return Session(cfg, pctx, data, model, grad_sync, optimizer)


def close_session(sess: Session) -> None:
    sess.grad_sync.remove_hooks()
    destroy_parallel()


class _GradTap:
    """Optimizer proxy: calls ``fn()`` when the step asks for the gradient norm, i.e. once the step's
    gradient is complete in ``param.main_grad`` and before clipping and the update."""

    def __init__(self, optimizer, fn):
        self._opt, self._fn = optimizer, fn

    def grad_norm(self) -> float:
        self._fn()
        return self._opt.grad_norm()

    def __getattr__(self, name):
        return getattr(self._opt, name)


def train_steps(sess: Session, n: int, on_grad=None, label: str = "train") -> list[float]:
    """Run ``n`` optimizer steps (the config's global batch, LR schedule over ``max(train.steps, n)``
    steps, clipping). ``on_grad(step)`` (0-based) is called with the step's full gradient in every
    ``param.main_grad``. Returns the per-step losses (nats)."""
    cfg, t = sess.cfg, sess.cfg.train
    opt = _GradTap(sess.optimizer, lambda: on_grad(sess.step)) if on_grad else sess.optimizer
    total = max(t.steps, sess.step + n)
    losses, every, t0 = [], max(1, n // 10), time.perf_counter()
    for i in range(n):
        batches = train_micro_batches(sess.data.train, sess.consumed, cfg, sess.pctx)
        scale = lr_at(sess.step, max_lr=1.0, min_lr=cfg.optimizer.min_lr / cfg.optimizer.lr,
                      warmup_steps=t.warmup_steps, total_steps=total, style=t.lr_decay_style)
        res = train_step(sess.model, batches, sess.grad_sync, opt, sess.pctx, scale, cfg.optimizer.clip_grad,
                         t.autocast_dtype)
        sess.consumed += t.global_batch_size
        sess.step += 1
        losses.append(res.loss)
        if (i + 1) % every == 0 or i + 1 == n:
            print(f"{label} step {i + 1}/{n}  loss {res.loss:.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return losses


def linear_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, weight) of every linear layer (column- and row-parallel, including the output layer)."""
    return [(f"{name}.weight", m.weight) for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def capture_rank_grads(sess: Session, ranks: int) -> tuple[list[str], dict[str, list[torch.Tensor]], float]:
    """Per-rank gradients of every linear weight: rank r's micro-batch is global samples
    ``consumed + r * m .. consumed + (r + 1) * m - 1`` (m = ``train.micro_batch_size``).

    Returns (names, {name: [R float32 gradients]}, mean loss over the ranks).
    """
    cfg, pctx = sess.cfg, sess.pctx
    named = linear_weights(sess.model)
    names, params = [n for n, _ in named], [p for _, p in named]
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    m, losses = cfg.train.micro_batch_size, []
    for r in range(ranks):
        start = sess.consumed + r * m
        mb = sess.data.train.micro_batch(list(range(start, start + m)))
        tokens, labels, mask = (mb[k].to(pctx.device) for k in ("tokens", "labels", "loss_mask"))
        with autocast_context(pctx, cfg.train.autocast_dtype):
            per_token = sess.model(tokens, labels)
        loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
        for n, g in zip(names, torch.autograd.grad(loss, params)):
            grads[n].append(g.detach().float())
        losses.append(float(loss.detach()))
    return names, grads, sum(losses) / len(losses)


# -- evaluation ----------------------------------------------------------------------------------------
def _mean(vals):
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def evaluate_codec(codec: dict, names: list[str], grads: dict[str, list[torch.Tensor]],
                   directions: bool = True) -> dict:
    """Per-layer and overall metrics of one codec (see the module docstring for the keys)."""
    layers, hats = [], []
    for n in names:
        g_hat = simulate_reduce(grads[n], codec)
        met = fidelity_metrics(g_hat, grads[n], codec, directions=directions)
        layers.append({"name": n, "shape": list(g_hat.shape), **met})
        hats.append(g_hat.reshape(-1))
    ranks = len(next(iter(grads.values())))
    cat = [torch.cat([grads[n][r].reshape(-1) for n in names]) for r in range(ranks)]
    overall = fidelity_metrics(torch.cat(hats), cat, None, directions=False)
    for k in ("dir_err_top", "dir_err_tail", "n_directions"):
        overall.pop(k)
    sat, el = sum(x["saturated"] for x in layers), sum(x["elements"] for x in layers)
    und, nz = sum(x["underflow_count"] for x in layers), sum(x["nonzero"] for x in layers)
    overall.update(saturated=sat, elements=el, saturation=sat / el if el else 0.0, underflow_count=und, nonzero=nz,
                   underflow=und / nz if nz else 0.0, mean_layer_rel_l2=_mean([x["rel_l2"] for x in layers]),
                   mean_layer_dir_err_top=_mean([x["dir_err_top"] for x in layers]),
                   mean_layer_dir_err_tail=_mean([x["dir_err_tail"] for x in layers]))
    return {"overall": overall, "layers": layers}


def _bpe(c: dict) -> float:
    if c["dtype"] in ("fp32", "bf16", "nvfp4"):
        return bytes_per_element(c["dtype"])
    return bytes_per_element(c["dtype"], c["block_size"] if c["scaling"] == "block" else None)


def _f(v, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, fmt)


_COLS = [("RelL2", "rel_l2", ".3e"), ("SQNR dB", "sqnr_db", ".2f"), ("cosine", "cosine", ".6f"),
         ("MaxErr", "max_err", ".2e"), ("sat", "saturation", ".2e"), ("underflow", "underflow", ".2e"),
         ("dir top", "dir_err_top", ".2e"), ("dir tail", "dir_err_tail", ".2e")]


def format_table(results: list[dict], per_layer: bool = False) -> str:
    """Readable table: one row per codec (overall), and with ``per_layer`` one block per codec."""
    head = (f"{'codec':<30} {'B/elem':>6} {'RelL2':>10} {'layer RelL2':>11} {'SQNR dB':>8} {'cosine':>9} "
            f"{'MaxErr':>9} {'sat':>9} {'underflow':>9} {'dir top':>9} {'dir tail':>9}")
    lines = ["overall (RelL2/SQNR/cosine/MaxErr of the concatenated linear weights; 'layer RelL2' = mean over "
             "layers; dir top/tail = mean over layers of the per-layer medians)", head, "-" * len(head)]
    for res in results:
        o = res["overall"]
        lines.append(f"{res['codec']:<30} {res['bytes_per_element']:>6.3f} {_f(o['rel_l2'], '.3e'):>10} "
                     f"{_f(o['mean_layer_rel_l2'], '.3e'):>11} {_f(o['sqnr_db'], '.2f'):>8} "
                     f"{_f(o['cosine'], '.6f'):>9} {_f(o['max_err'], '.2e'):>9} {_f(o['saturation'], '.2e'):>9} "
                     f"{_f(o['underflow'], '.2e'):>9} {_f(o['mean_layer_dir_err_top'], '.2e'):>9} "
                     f"{_f(o['mean_layer_dir_err_tail'], '.2e'):>9}")
    if per_layer:
        for res in results:
            lines += ["", f"per layer: {res['codec']}"]
            h = f"{'layer':<34} {'shape':>11} " + " ".join(f"{c:>9}" for c, _, _ in _COLS)
            lines += [h, "-" * len(h)]
            for x in res["layers"]:
                shape = "x".join(str(s) for s in x["shape"])
                lines.append(f"{x['name']:<34} {shape:>11} " + " ".join(f"{_f(x[k], f):>9}" for _, k, f in _COLS))
    return "\n".join(lines)


def _json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` as strict JSON (non-finite floats as null), creating parent folders."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_json_safe(obj), f, indent=1, allow_nan=False)
        f.write("\n")


# -- --geo: GeoFP8 coordinate-system ablations ---------------------------------------------------------
GEO_FP8 = "fp8_e4m3:tensor"
GEO_FP4 = "nvfp4"
TARGET_REDUCTION_PCT = 60.0   # issue target: RelL2 at r = 32 at least 60% below Euclidean FP8 (paper: 67.4%)
TARGET_TAIL_RATIO = 5.0       # issue target: tail per-direction error at least 5x lower
PAPER_REDUCTION_PCT = 67.4


class _OutputGradStats:
    """Sums ``sum_t g_t g_t^T`` (FP32 ``[d_out, d_out]``) of the gradient w.r.t. each module's output
    (a forward hook registers a tensor hook on the output), i.e. the K-FAC output factor's numerator;
    the per-token loss scaling cancels because the damping is relative."""

    def __init__(self, modules: dict):
        self.modules, self.sums, self._handles = modules, {}, []

    def arm(self):
        self.disarm()
        self.sums.clear()
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_hook(self._hook(name)))

    def disarm(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name):
        def on_grad(g):
            x = g.detach().reshape(-1, g.shape[-1]).float()
            s = x.T @ x
            self.sums[name] = self.sums[name] + s if name in self.sums else s

        def hook(module, args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(on_grad)
        return hook


@dataclass
class GeoCapture:
    """One capture: per-rank gradients and the K-FAC factors of the same micro-batches.

    ``A[name]``: float32 ``[d_in, d_in]`` = sum over all ranks' tokens of a a^T / token count (the
    DP-averaged input factor, via :class:`~megatron_geo.geometry.stats.InputStats` and its ``reduce``);
    ``S_hooks[name]``: float32 ``[d_out, d_out]`` output factor from backward hooks (None unless asked).
    """

    step: int
    names: list
    grads: dict
    loss: float
    A: dict
    S_hooks: dict | None
    seconds: float


def capture_geo(sess: Session, ranks: int, modules: dict, output_hooks: bool) -> GeoCapture:
    """:func:`capture_rank_grads` with the input statistics (and optionally output-gradient statistics)
    of ``modules`` (``{weight name: module}``) collected on the same micro-batches."""
    t0 = time.perf_counter()
    stats = InputStats(modules)
    ostats = _OutputGradStats(modules) if output_hooks else None
    stats.arm()
    if ostats:
        ostats.arm()
    try:
        names, grads, loss = capture_rank_grads(sess, ranks)
    finally:
        stats.disarm()
        if ostats:
            ostats.disarm()
    A = {n: a.cpu() for n, a in stats.reduce(sess.pctx.dp_group).items()}  # world of one: the pooled mean
    S = {n: (s / stats.counts[n]).cpu() for n, s in ostats.sums.items()} if ostats else None
    grads = {n: [g.cpu() for g in gs] for n, gs in grads.items()}
    return GeoCapture(sess.step, names, grads, loss, A, S, time.perf_counter() - t0)


def _side(kind: str, rank: int | None = None, block: int | None = None, damping: float = 1e-3,
          power: float | str = 0.5,
          factor: str = "kfac") -> dict:
    return {"kind": kind, "rank": rank, "block": block, "damping": damping, "power": power, "factor": factor}


def _side_label(sd: dict | None) -> str:
    if sd is None:
        return "-"
    k = sd["kind"]
    what = {"lowrank": f"r{sd['rank']}", "full": "full", "diag": "diag", "block": f"block{sd['block']}",
            "sketch": f"r{sd['rank']} sketch{sd['block']}"}[k]
    pw = sd["power"]
    extra = (" p-search" if pw == "search" else f" p{pw:g}") if pw != 0.5 else ""
    extra += " gram" if sd["factor"] == "gram" else ""
    return f"{what} d{sd['damping']:g}{extra}"


def geo_rows(rank: int, damping: float, lowranks: list[int], blocks: list[int], dampings: list[float],
             staleness: list[int], investigate: bool = True, search: tuple = (), sketch: int = 64,
             fp8: str = GEO_FP8) -> list[dict]:
    """The ablation rows: ``{"key", "group", "label", "codec", "input", "output" (side dicts or None),
    "capture" (step offset of the gradients), "stats" (offset of the factors), "baseline" (key)}``.

    ``search``: the candidate powers of ``geo.power_search`` (rows with ``power="search"``: per layer,
    the power chosen as the trainer chooses it, from the gradients of the factors' capture). ``fp8``: the
    codec of every row not in the NVFP4 group (default E4M3, tensor scaling)."""
    geo = _side("lowrank", rank, damping=damping)
    rows = []

    def add(group, label, codec=None, inp=None, out=None, capture=0, stats=0, baseline=None):
        codec = codec or fp8
        key = f"{codec}|in={_side_label(inp)}|out={_side_label(out)}|g{capture}|A{stats}"
        rows.append({"key": key, "group": group, "label": label, "codec": codec, "input": inp, "output": out,
                     "capture": capture, "stats": stats, "baseline": baseline or key})
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
    add("A approx", f"input r{rank} from a sketch (k = {sketch})", inp=_side("sketch", rank, block=sketch,
                                                                              damping=damping), baseline=eu)
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
    e4 = add("nvfp4", "NVFP4 Euclidean", codec=GEO_FP4)
    add("nvfp4", f"NVFP4 input-side geo r{rank}", codec=GEO_FP4, inp=geo, baseline=e4)
    if search:
        add("nvfp4", f"NVFP4 input r{rank}, power search", codec=GEO_FP4,
            inp=_side("lowrank", rank, damping=damping, power="search"), baseline=e4)
    if investigate:
        # why (docs/geofp8_fidelity.md): D's exponent, and a factor that measures the gradient's own energy
        add("investigate", f"input r{rank}, D power 1/4", inp=_side("lowrank", rank, damping=damping, power=0.25),
            baseline=eu)
        add("investigate", "input full, D power 1/4", inp=_side("full", damping=damping, power=0.25), baseline=eu)
        add("investigate", f"input r{rank}, grad Gram, power 1/4",
            inp=_side("lowrank", rank, damping=damping, power=0.25, factor="gram"), baseline=eu)
        add("investigate", f"NVFP4 input r{rank}, D power 1/4", codec=GEO_FP4,
            inp=_side("lowrank", rank, damping=damping, power=0.25), baseline=e4)
    # the same configuration listed in two groups is computed once (the rows share the key)
    return rows


class _Transforms:
    """Cache of coordinate transforms per (capture, side, layer, spec)."""

    def __init__(self, caps: dict, output_factor: str, search: tuple = ()):
        self.caps, self.output_factor, self.cache = caps, output_factor, {}
        self.search, self.chosen = tuple(search), {}
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
            else:
                self.cache[key] = build_coordinate_transform(self.factor(offset, side, name, sd["factor"]), sd["kind"],
                                                             sd["rank"] or 0, sd["damping"], sd["block"] or 128,
                                                             sd["power"], sketch_size=sd["block"] or 64,
                                                             seed=zlib.crc32(name.encode()))
            self.seconds += time.perf_counter() - t0
        return self.cache[key]

    def _searched(self, offset: int, name: str, sd: dict, codec):
        """The trainer's ``geo.power_search`` choice for one layer: the power-1 transform of A, each
        candidate's round-trip error summed over the capture's ranks, the smallest wins."""
        base = build_coordinate_transform(self.factor(offset, "input", name), "lowrank", sd["rank"] or 0,
                                          sd["damping"], power=1.0)
        errs = sum(roundtrip_errors(g, base, list(self.search), lambda x: quantize_roundtrip(x, codec))
                   for g in self.caps[offset].grads[name])
        p = pick_powers(errs.view(1, -1), list(self.search))[0]
        self.chosen.setdefault((offset, codec_label(codec)), {})[name] = p
        return with_power(base, p)


def _aggregate(names: list[str], per_layer: dict, hats: dict, grads: dict) -> dict:
    """Overall metrics of a scope (concatenated layers), as :func:`evaluate_codec` reports them."""
    ranks = len(grads[names[0]])
    cat = [torch.cat([grads[n][r].reshape(-1) for n in names]) for r in range(ranks)]
    o = fidelity_metrics(torch.cat([hats[n].reshape(-1) for n in names]), cat, None, directions=False)
    for k in ("dir_err_top", "dir_err_tail", "n_directions", "saturation", "underflow", "saturated", "elements",
              "underflow_count", "nonzero"):
        o.pop(k)
    ls = [per_layer[n] for n in names]
    sat, el = sum(x["saturated"] for x in ls), sum(x["elements"] for x in ls)
    und, nz = sum(x["underflow_count"] for x in ls), sum(x["nonzero"] for x in ls)
    o.update(saturation=sat / el if el else 0.0, underflow=und / nz if nz else 0.0,
             mean_layer_rel_l2=_mean([x["rel_l2"] for x in ls]),
             mean_layer_dir_err_top=_mean([x["dir_err_top"] for x in ls]),
             mean_layer_dir_err_tail=_mean([x["dir_err_tail"] for x in ls]))
    return o


def evaluate_geo_row(row: dict, caps: dict, tf: _Transforms, scopes: dict, directions: bool, fp64: bool) -> dict:
    """Per-layer metrics of one row on every linear weight, and the overall metrics of each scope."""
    cap = caps[row["capture"]]
    per_layer, hats = {}, {}
    for n in cap.names:
        t_in = tf.get(row["stats"], "input", n, row["input"], row["codec"])
        t_out = tf.get(row["stats"], "output", n, row["output"])
        hats[n], per_layer[n] = geo_reduce_and_metrics(cap.grads[n], row["codec"], t_in, t_out,
                                                       directions=directions, fp64=fp64)
    out = {scope: _aggregate(names, per_layer, hats, cap.grads) for scope, names in scopes.items()}
    out["layers"] = [{"name": n, "shape": list(hats[n].shape), **per_layer[n]} for n in cap.names]
    return out


def _energy_fraction(g: torch.Tensor, U: torch.Tensor) -> float:
    gd = g.double()
    return float((gd @ U.double()).norm() ** 2 / gd.norm() ** 2) if gd.norm() > 0 else 0.0


def geo_diagnostics(cap: GeoCapture, names: list[str], rank: int, damping: float,
                    fp8: str = GEO_FP8) -> list[dict]:
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
        inv2 = (float((1.0 / d ** 2).sum()) + (t.d_in - d.numel())) / t.d_in
        model_ratio = math.sqrt(wire_e / raw_e * inv2) if raw_e > 0 else None
        # the model's optimum over all D of a rank-r transform in A's eigenbasis (Cauchy-Schwarz):
        # ratio^2 >= (sum_{i<=r} sqrt(e_i) + sqrt(e_rest (d_in - r)))^2 / (d_in E), e_i = sum_r ||G_r u_i||^2
        V = torch.linalg.eigh(0.5 * (A + A.T))[1].flip(1)
        e = sum(((x.double() @ V) ** 2).sum(0) for x in gs)
        E, din = float(e.sum()), A.shape[0]
        rr = min(rank, din)
        best_r = ((float(e[:rr].sqrt().sum()) + math.sqrt(float(e[rr:].sum()) * (din - rr))) ** 2 / (din * E)
                  if E else None)
        best_full = float(e.sqrt().sum()) ** 2 / (din * E) if E else None
        rt_e = fidelity_metrics(simulate_reduce(gs[:1], fp8), gs[:1], None, directions=False)["rel_l2"]
        rt_g = geo_reduce_and_metrics(gs[:1], fp8, t, None, directions=False)[1]["rel_l2"]
        out.append({
            "name": n, "shape": list(gs[0].shape), "d_in": int(A.shape[0]),
            "a_top8_trace_frac": float(ev[:8].sum()) / tr if tr else None,
            "a_top16_trace_frac": float(ev[:16].sum()) / tr if tr else None,
            "a_topr_trace_frac": float(ev[:rank].sum()) / tr if tr else None,
            "a_participation_rank": tr ** 2 / float((ev ** 2).sum()) if tr else None,
            "a_lambda1_over_mean": float(ev[0]) / (tr / ev.numel()) if tr else None,
            "a_lambda_r_over_ref": (float(ev[min(rank, ev.numel()) - 1] / ev[rank:].mean())
                                    if ev.numel() > rank else None),
            "d_min": float(t.d.min()) if t.d.numel() else None,
            "grad_energy_topr": _energy_fraction(g, U),
            "rank_grad_energy_topr": _mean([_energy_fraction(x, U) for x in gs]),
            "rank_cancellation": math.sqrt(raw_e / len(gs)) / float(g.norm()) if float(g.norm()) > 0 else None,
            "wire_energy_ratio": wire_e / raw_e if raw_e > 0 else None,
            "model_rel_l2_ratio": model_ratio,
            "model_best_ratio_r": math.sqrt(best_r) if best_r is not None else None,
            "model_best_ratio_full": math.sqrt(best_full) if best_full is not None else None,
            "rank_grad_energy_topr_sum": float(e[:rr].sum()) / E if E else None,
            "roundtrip_rel_l2_euclid": rt_e, "roundtrip_rel_l2_geo": rt_g,
        })
    return out


def _targets(rows: list[dict], key: str) -> dict:
    r = next(x for x in rows if x["key"] == key)
    s = r["selected"]
    red, tail = s.get("rel_l2_reduction_pct"), s.get("tail_ratio")
    return {"row": r["label"], "rel_l2_reduction_pct": red, "target_reduction_pct": TARGET_REDUCTION_PCT,
            "paper_reduction_pct": PAPER_REDUCTION_PCT,
            "reduction_met": red is not None and red >= TARGET_REDUCTION_PCT,
            "tail_ratio": tail, "target_tail_ratio": TARGET_TAIL_RATIO,
            "tail_met": tail is not None and tail >= TARGET_TAIL_RATIO}


def _add_relative(rows: list[dict]) -> None:
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        b = by_key[r["baseline"]]
        for scope in ("selected", "all_linear"):
            o, ob = r[scope], b[scope]
            o["rel_l2_reduction_pct"] = (100.0 * (1.0 - o["rel_l2"] / ob["rel_l2"])
                                         if o["rel_l2"] is not None and ob["rel_l2"] else None)
            o["mean_layer_rel_l2_reduction_pct"] = (
                100.0 * (1.0 - o["mean_layer_rel_l2"] / ob["mean_layer_rel_l2"])
                if o["mean_layer_rel_l2"] is not None and ob["mean_layer_rel_l2"] else None)
            t, tb = o["mean_layer_dir_err_tail"], ob["mean_layer_dir_err_tail"]
            o["tail_ratio"] = tb / t if t and tb is not None else None
            t, tb = o["mean_layer_dir_err_top"], ob["mean_layer_dir_err_top"]
            o["top_ratio"] = tb / t if t and tb is not None else None


_GEO_COLS = [("RelL2", "rel_l2", ".3e"), ("vs Eucl %", "rel_l2_reduction_pct", "+.1f"),
             ("layer RelL2", "mean_layer_rel_l2", ".3e"), ("SQNR dB", "sqnr_db", ".2f"), ("cosine", "cosine", ".6f"),
             ("dir top", "mean_layer_dir_err_top", ".2e"), ("dir tail", "mean_layer_dir_err_tail", ".2e"),
             ("tail E/geo", "tail_ratio", ".2f"), ("underflow", "underflow", ".2e")]


def format_geo_table(rows: list[dict], scope: str, markdown: bool = False) -> str:
    """One line per row of the ablation for ``scope`` (``selected`` or ``all_linear``)."""
    lines = []
    if markdown:
        lines.append("| group | coordinates | codec | " + " | ".join(c for c, _, _ in _GEO_COLS) + " |")
        lines.append("|---|---|---|" + "---:|" * len(_GEO_COLS))
    else:
        h = f"{'group':<12} {'coordinates':<34} {'codec':<16} " + " ".join(f"{c:>11}" for c, _, _ in _GEO_COLS)
        lines += [h, "-" * len(h)]
    for r in rows:
        o = r[scope]
        vals = [_f(o.get(k), f) for _, k, f in _GEO_COLS]
        if markdown:
            lines.append(f"| {r['group']} | {r['label']} | {r['codec']} | " + " | ".join(vals) + " |")
        else:
            lines.append(f"{r['group']:<12} {r['label']:<34} {r['codec']:<16} " + " ".join(f"{v:>11}" for v in vals))
    return "\n".join(lines)


_DIAG_COLS = [("d_in", "d_in", "d"), ("A top8", "a_top8_trace_frac", ".3f"), ("A top-r", "a_topr_trace_frac", ".3f"),
              ("A eff. rank", "a_participation_rank", ".1f"), ("l1/mean", "a_lambda1_over_mean", ".1f"),
              ("d_min", "d_min", ".3f"), ("E(g) top-r", "grad_energy_topr", ".3f"),
              ("E(g_r) top-r", "rank_grad_energy_topr", ".3f"), ("cancel", "rank_cancellation", ".2f"),
              ("meas. ratio", "measured_rel_l2_ratio", ".3f"), ("model ratio", "model_rel_l2_ratio", ".3f"),
              ("best r", "model_best_ratio_r", ".3f"), ("best full", "model_best_ratio_full", ".3f"),
              ("1-rank E", "roundtrip_rel_l2_euclid", ".3e"),
              ("1-rank geo", "roundtrip_rel_l2_geo", ".3e")]


def format_diag_table(diag: list[dict], markdown: bool = False) -> str:
    if markdown:
        lines = ["| layer | " + " | ".join(c for c, _, _ in _DIAG_COLS) + " |",
                 "|---|" + "---:|" * len(_DIAG_COLS)]
        for x in diag:
            lines.append(f"| {x['name']} | " + " | ".join(_f(x[k], f) for _, k, f in _DIAG_COLS) + " |")
        return "\n".join(lines)
    h = f"{'layer':<30} " + " ".join(f"{c:>12}" for c, _, _ in _DIAG_COLS)
    lines = [h, "-" * len(h)]
    for x in diag:
        lines.append(f"{x['name']:<30} " + " ".join(f"{_f(x[k], f):>12}" for _, k, f in _DIAG_COLS))
    return "\n".join(lines)


def check_geo_fp8_codec(spec: str) -> str:
    """``--geo-fp8-codec``: an FP8 codec the trainer also accepts (E4M3/E5M2, tensor scaling or a
    power-of-two block, no rotation); returns its canonical label.

    Raises:
        ValueError: anything else, naming the value and the accepted forms.
    """
    c = parse_codec(spec)
    ok = c["dtype"] in ("fp8_e4m3", "fp8_e5m2") and c["transform"] == "none" and \
        (c["scaling"] == "tensor" or is_pow2(c["block_size"]))
    if not ok:
        raise ValueError(f"--geo-fp8-codec={spec!r}: the FP8 rows need fp8_e4m3 or fp8_e5m2 with tensor scaling or a "
                         f"power-of-two block and no rotation, e.g. fp8_e5m2:tensor or fp8_e4m3:block128 (NVFP4 has "
                         f"its own rows)")
    return codec_label(c)


def _targets_text(tg: dict, n_sel: int, codec: str = GEO_FP8) -> str:
    red, tail = tg["rel_l2_reduction_pct"], tg["tail_ratio"]
    tail_verdict = ("not measured (--no-directions)" if tail is None
                    else f"measured {_f(tail, '.2f')}x -> {'MET' if tg['tail_met'] else 'NOT MET'}")
    return (f"targets (issue; {tg['row']} on the {n_sel} selected layers, {codec}):\n"
            f"  RelL2 reduction vs Euclidean >= {TARGET_REDUCTION_PCT:.0f}% (paper {PAPER_REDUCTION_PCT}%): "
            f"measured {_f(red, '.1f')}% -> {'MET' if tg['reduction_met'] else 'NOT MET'}\n"
            f"  tail per-direction error >= {TARGET_TAIL_RATIO:.0f}x lower: {tail_verdict}")


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _float_list(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def run_geo(sess: Session, args) -> dict:
    """The ``--geo`` ablation: capture at t (= after the warm-up), evaluate every row, train on and capture
    at t + k for the staleness rows. Returns the ``geo`` JSON section."""
    timings = {}
    selected = list(select_parameters(sess.model, args.geo_layers))
    mods = dict(sess.model.named_modules())
    modules = {n: mods[n[: -len(".weight")]] for n, _ in linear_weights(sess.model)}
    staleness = sorted(set(_int_list(args.geo_staleness)))
    search = parse_power_search(args.geo_power_search, "--geo-power-search")
    fp8 = check_geo_fp8_codec(args.geo_fp8_codec)
    rows = geo_rows(args.geo_rank, args.geo_damping, _int_list(args.geo_lowranks), _int_list(args.geo_blocks),
                    _float_list(args.geo_dampings), staleness, not args.no_investigate, search, fp8=fp8)
    hooks = args.output_factor == "hooks"
    caps = {0: capture_geo(sess, args.ranks, modules, hooks)}
    t0 = sess.step
    timings["train_between_captures_s"] = 0.0
    for k in staleness:
        ts = time.perf_counter()
        train_steps(sess, t0 + k - sess.step, label=f"staleness (to t+{k})")
        timings["train_between_captures_s"] += time.perf_counter() - ts
        caps[k] = capture_geo(sess, args.ranks, modules, hooks)
    timings["capture_s"] = sum(c.seconds for c in caps.values())
    names = caps[0].names
    scopes = {"selected": [n for n in names if n in selected], "all_linear": names}
    tf = _Transforms(caps, args.output_factor, search)
    done, t_eval = {}, time.perf_counter()
    for r in rows:
        if r["key"] not in done:
            ts = time.perf_counter()
            done[r["key"]] = evaluate_geo_row(r, caps, tf, scopes, not args.no_directions,
                                              args.geo_transform_precision == "fp64")
            print(f"  {r['group']:<12} {r['label']:<36} RelL2(selected) {done[r['key']]['selected']['rel_l2']:.3e}"
                  f"  ({time.perf_counter() - ts:.1f} s)", flush=True)
        r.update(done[r["key"]])
    timings["evaluate_s"] = time.perf_counter() - t_eval
    timings["build_transforms_s"] = tf.seconds
    _add_relative(rows)
    geo_key = rows[1]["key"]
    ts = time.perf_counter()
    diag = geo_diagnostics(caps[0], scopes["selected"], args.geo_rank, args.geo_damping, fp8)
    timings["diagnostics_s"] = time.perf_counter() - ts
    lay_e = {x["name"]: x["rel_l2"] for x in rows[0]["layers"]}
    lay_g = {x["name"]: x["rel_l2"] for x in rows[1]["layers"]}
    for x in diag:
        x["measured_rel_l2_ratio"] = lay_g[x["name"]] / lay_e[x["name"]] if lay_e[x["name"]] else None
    return {"settings": {"layers": args.geo_layers, "rank": args.geo_rank, "damping": args.geo_damping,
                         "damping_is_relative": True, "lowranks": _int_list(args.geo_lowranks),
                         "blocks": _int_list(args.geo_blocks), "dampings": _float_list(args.geo_dampings),
                         "staleness": staleness, "output_factor": args.output_factor, "power_search": list(search),
                         "transform_precision": args.geo_transform_precision, "fp8_codec": fp8,
                         "fp4_codec": GEO_FP4},
            "capture_steps": {str(k): c.step for k, c in caps.items()},
            "capture_losses": {str(k): c.loss for k, c in caps.items()},
            "power_search_choices": {f"A@t+{k[0]} {k[1]}": v for k, v in tf.chosen.items()},
            "selected_layers": scopes["selected"], "rows": rows, "targets": _targets(rows, geo_key),
            "diagnostics": diag, "timings": timings}


def geo_report(out: dict, markdown: bool = False) -> str:
    """Text (or Markdown) report of a ``--geo`` run: targets, both tables, diagnostics."""
    g = out["geo"]
    n_sel = len(g["selected_layers"])
    st = g["settings"]
    head = (f"GeoFP8 coordinate ablation: {out['ranks']} ranks x {out['micro_batch_size']} samples, capture after "
            f"{out['warmup_steps']} steps (t = {g['capture_steps']['0']}); rank {st['rank']}, "
            f"damping {st['damping']:g} "
            f"x mean eigenvalue; output factor from {st['output_factor']}; transforms applied in "
            f"{st['transform_precision']}. RelL2 / SQNR / cosine: concatenated layers of the scope; layer RelL2, dir "
            f"top / tail: means over layers of the per-layer values (medians over the first / last quarter of each "
            f"gradient's singular directions); vs Eucl %: RelL2 reduction against the row's Euclidean baseline (same "
            f"codec, same capture); tail E/geo: baseline tail error / this row's.")
    sel_t = format_geo_table(g["rows"], "selected", markdown)
    all_t = format_geo_table(g["rows"], "all_linear", markdown)
    diag = format_diag_table(g["diagnostics"], markdown)
    tg = _targets_text(g["targets"], n_sel, st.get("fp8_codec", GEO_FP8))
    choices = g.get("power_search_choices") or {}
    if choices:
        sel = g["selected_layers"]
        tg += "\npowers chosen by the power search (A at t; selected layers): " + "; ".join(
            f"{k.split(' ', 1)[1]}: " + ", ".join(f"{n.removesuffix('.weight')}={v[n]:g}" for n in sel if n in v)
            for k, v in choices.items() if k.startswith("A@t+0 "))
    diag_note = ("diagnostics (capture t, input side r = {r}): A top8 / top-r = share of trace(A) in the top 8 / r "
                 "eigenvalues; eff. rank = trace(A)^2 / trace(A^2); l1/mean = lambda_1 / mean eigenvalue; d_min = "
                 "smallest D entry; E(g) top-r = share of the averaged gradient's energy in A's top-r input "
                 "directions (E(g_r): mean over ranks); cancel = RMS rank-gradient norm / norm of the average; "
                 "meas. ratio = RelL2 geo / Euclidean of the layer (FP8); model ratio = sqrt(wire energy / raw energy "
                 "* mean 1/d^2), that ratio if the quantization error were white in wire coordinates with energy "
                 "proportional to the wire's; best r / best full = the smallest model ratio any rank-r (any "
                 "full-rank) diagonal scaling in A's eigenbasis can reach (Cauchy-Schwarz over the gradient energy "
                 "e_i per eigen-direction); 1-rank E / geo = one gradient quantized and dequantized "
                 "(no reduce), RelL2.").format(r=st["rank"])
    if markdown:
        return "\n\n".join([head, "```\n" + tg + "\n```",
                            f"**Selected layers** (`{st['layers']}`, {n_sel} layers)", sel_t,
                            f"**All linear weights** ({len(out['layers'])} layers, every one transformed)", all_t,
                            "**Diagnostics**: " + diag_note[len("diagnostics "):], diag])
    return "\n\n".join([head, f"selected layers ({st['layers']}, {n_sel} layers):\n" + sel_t,
                        f"all linear weights ({len(out['layers'])} layers, each transformed):\n" + all_t,
                        diag_note + "\n" + diag, tg])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Overrides: section.key=value, e.g. model.num_layers=2 train.seed=7",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config, repeatable, merged in order (default configs/tiny.yaml)")
    p.add_argument("--warmup-steps", type=int, default=100, help="training steps before capturing (default 100)")
    p.add_argument("--ranks", type=int, default=4, help="simulated DP ranks = micro-batches captured (default 4)")
    p.add_argument("--codecs", nargs="+", default=DEFAULT_CODECS, metavar="SPEC",
                   help="codec specs (default: %(default)s)")
    p.add_argument("--out", default="runs/grad_fidelity.json", help="JSON output (default %(default)s)")
    p.add_argument("--per-layer", action="store_true", help="also print one row per layer and codec")
    p.add_argument("--no-directions", action="store_true", help="skip the per-direction error (FP64 SVDs)")
    g = p.add_argument_group("GeoFP8 ablation (--geo)")
    g.add_argument("--geo", action="store_true",
                   help="ablation mode: FP8 (--geo-fp8-codec, default E4M3 tensor scaling) and NVFP4 reduces in "
                        "GeoFP8 coordinate systems instead of the --codecs table")
    g.add_argument("--geo-layers", default="layers.*.mlp.down_proj.weight",
                   help="comma-separated globs of the GeoFP8-selected weights (default %(default)s)")
    g.add_argument("--geo-rank", type=int, default=32, help="rank of the GeoFP8 transform (default 32)")
    g.add_argument("--geo-damping", type=float, default=1e-3,
                   help="damping relative to the factor's mean eigenvalue (default 1e-3)")
    g.add_argument("--geo-lowranks", default="8,16,32", help="low-rank sweep (default %(default)s)")
    g.add_argument("--geo-blocks", default="32,128", help="block-diagonal block sizes (default %(default)s)")
    g.add_argument("--geo-dampings", default="1e-4,1e-3,1e-2,1e-1", help="damping sweep at --geo-rank")
    g.add_argument("--geo-fp8-codec", default=GEO_FP8, metavar="SPEC",
                   help="codec of the FP8 rows (default %(default)s; e.g. fp8_e5m2:tensor, fp8_e4m3:block128)")
    g.add_argument("--geo-power-search", default="0.5,0.375,0.25,0.125,0",
                   help="candidate powers for the geo.power_search rows (as the trainer's key; '' drops the rows)")
    g.add_argument("--geo-staleness", default="10,25,50",
                   help="steps after t at which the transform built at t is applied to new gradients; '' skips "
                        "(default %(default)s)")
    g.add_argument("--output-factor", choices=("grads", "hooks"), default="grads",
                   help="output-side factor: sum_r G_r G_r^T / (R d_in) from the weight gradients, or E[g g^T] of "
                        "the output gradients from backward hooks (default %(default)s)")
    g.add_argument("--geo-transform-precision", choices=("fp64", "fp32"), default="fp64",
                   help="apply the transforms in FP64 (only the codec loses) or in the trainer's FP32")
    g.add_argument("--no-investigate", action="store_true",
                   help="skip the 'investigate' rows (D power 1/4, gradient-Gram oracle factor)")
    g.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown")
    p.add_argument("overrides", nargs="*", help="dotted section.key=value overrides applied last")
    args = p.parse_args(argv)
    # --codecs takes one or more values, so overrides written after it land there: move them back
    args.overrides = [c for c in args.codecs if "=" in c] + args.overrides
    args.codecs = [c for c in args.codecs if "=" not in c]
    if not args.codecs:
        p.error("--codecs needs at least one codec spec")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.ranks < 1 or args.warmup_steps < 0:
        print("error: --ranks must be >= 1 and --warmup-steps >= 0", file=sys.stderr)
        return 2
    try:
        specs = [(s, parse_codec(s)) for s in args.codecs]
        if args.geo:   # every --geo option is checked before the warm-up training
            parse_power_search(args.geo_power_search, "--geo-power-search")
            args.geo_fp8_codec = check_geo_fp8_codec(args.geo_fp8_codec)
        sess = open_session(args.config, args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = sess.cfg
        print(f"model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, device {sess.pctx.device}; "
              f"training {args.warmup_steps} steps, then {args.ranks} ranks x {cfg.train.micro_batch_size} samples",
              flush=True)
        t_train = time.perf_counter()
        losses = train_steps(sess, args.warmup_steps, label="warmup")
        t_train = time.perf_counter() - t_train
        if args.geo:
            return _main_geo(sess, args, losses, t_train, t_start)
        names, grads, cap_loss = capture_rank_grads(sess, args.ranks)
        grads = {n: [g.cpu() for g in gs] for n, gs in grads.items()}
        results = []
        for spec, codec in specs:
            if "seed" not in spec:
                codec = normalize_codec({**codec, "seed": cfg.train.seed})  # the reducer's Hadamard signs
            res = evaluate_codec(codec, names, grads, directions=not args.no_directions)
            results.append({"codec": spec, "settings": codec, "bytes_per_element": _bpe(codec), **res})
    finally:
        close_session(sess)
    out = {"config_files": args.config or [os.path.relpath(DEFAULT_CONFIG, REPO_ROOT)], "overrides": args.overrides,
           "warmup_steps": args.warmup_steps, "ranks": args.ranks, "micro_batch_size": cfg.train.micro_batch_size,
           "device": str(sess.pctx.device), "train_loss_first": losses[0] if losses else None,
           "train_loss_last": losses[-1] if losses else None, "capture_loss": cap_loss,
           "layers": [{"name": n, "shape": list(grads[n][0].shape)} for n in names], "codecs": results,
           "wall_s": time.perf_counter() - t_start}
    print()
    print(f"gradient fidelity: {len(names)} linear weights, {args.ranks} ranks, after {args.warmup_steps} steps "
          f"(capture loss {cap_loss:.4f})")
    print(format_table(results, args.per_layer))
    write_json(args.out, out)
    print(f"\nwrote {args.out} ({out['wall_s']:.1f} s)")
    return 0


def _main_geo(sess: Session, args, losses: list[float], t_train: float, t_start: float) -> int:
    cfg = sess.cfg
    try:
        geo = run_geo(sess, args)
    except ValueError as e:  # a --geo-layers pattern that matches nothing, a bad list
        print(f"error: {e}", file=sys.stderr)
        return 2
    geo["timings"]["warmup_train_s"] = t_train
    layers = [{"name": x["name"], "shape": x["shape"]} for x in geo["rows"][0]["layers"]]
    out = {"mode": "geo", "config_files": args.config or [os.path.relpath(DEFAULT_CONFIG, REPO_ROOT)],
           "overrides": args.overrides, "warmup_steps": args.warmup_steps, "ranks": args.ranks,
           "micro_batch_size": cfg.train.micro_batch_size, "model": {k: getattr(cfg.model, k) for k in (
               "hidden_size", "ffn_hidden_size", "num_layers", "seq_length", "vocab_size")},
           "device": str(sess.pctx.device), "train_loss_first": losses[0] if losses else None,
           "train_loss_last": losses[-1] if losses else None, "capture_loss": geo["capture_losses"]["0"],
           "layers": layers, "geo": geo}
    out["wall_s"] = time.perf_counter() - t_start
    print()
    print(geo_report(out))
    write_json(args.out, out)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(geo_report(out, markdown=True) + "\n")
    print(f"\nwrote {args.out}" + (f" and {args.markdown}" if args.markdown else "") + f" ({out['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
