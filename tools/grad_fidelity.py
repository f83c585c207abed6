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
from dataclasses import dataclass

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.comm.codecs import bytes_per_element  # noqa: E402
from megatron_geo.comm.fidelity import fidelity_metrics, normalize_codec, parse_codec, simulate_reduce  # noqa: E402
from megatron_geo.config import ConfigError, load_config, validate_config  # noqa: E402
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
        sess = open_session(args.config, args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = sess.cfg
        print(f"model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, device {sess.pctx.device}; "
              f"training {args.warmup_steps} steps, then {args.ranks} ranks x {cfg.train.micro_batch_size} samples",
              flush=True)
        losses = train_steps(sess, args.warmup_steps, label="warmup")
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


if __name__ == "__main__":
    sys.exit(main())
