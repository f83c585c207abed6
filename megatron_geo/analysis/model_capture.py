"""Real gradients of the project's model for the offline fidelity tools: a one-process training session
built from a config exactly as ``pretrain_llama.py`` builds it, training steps, and captures of per-rank
gradients (R consecutive micro-batches stand in for R DP ranks) with the K-FAC input factor of the same
micro-batches (:class:`~megatron_geo.geometry.stats.InputStats`, the trainer's own hooks).

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ..config import load_config
from ..geometry import InputStats
from ..optim.schedule import lr_at
from ..parallel import LaunchEnv, destroy_parallel, init_parallel
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..training.data_setup import build_data, train_micro_batches
from ..training.setup import build_model_and_optimizer
from ..training.step import StepContext, autocast_context, train_step
from ..training.validate import validate_config
from .capture import Capture

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "tiny.yaml")


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
    model, gradient path and optimizer exactly as ``pretrain_llama.py`` does. With an explicit
    ``checkpoint.load=PATH`` (e.g. an imported pretrained model) the model starts from that checkpoint's
    weights (and its optimizer state, when it has one), loaded by the trainer's own resharding load; the
    session's step count stays 0.

    Raises:
        ConfigError: bad config or data, or a ``checkpoint.load`` that is not a complete checkpoint of this model.
    """
    cfg = load_config(config_files or [DEFAULT_CONFIG], overrides)
    if cfg.parallel.tensor != 1:
        print(f"note: parallel.tensor={cfg.parallel.tensor} -> 1 (these tools run one process)", flush=True)
        cfg.parallel.tensor = 1
    validate_config(cfg, 1)
    pctx = init_parallel(
        1,
        cfg.train.device,
        cfg.parallel.backend,
        cfg.parallel.timeout_minutes,
        LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"),
    )
    torch.manual_seed(cfg.train.seed)
    data = build_data(cfg, pctx)
    model, _, reducer, grad_sync, optimizer = build_model_and_optimizer(cfg, pctx)
    if cfg.checkpoint.load not in ("auto", "latest", "none"):
        load_weights(cfg, pctx, model, optimizer, reducer)
    return Session(cfg, pctx, data, model, grad_sync, optimizer)


def load_weights(cfg, pctx, model, optimizer, reducer) -> None:
    """Load the checkpoint ``cfg.checkpoint.load`` names into a freshly built model and optimizer (no GeoFP8
    state, no error feedback: the capture starts them fresh)."""
    from ..checkpoint.manager import explicit_checkpoint, read_meta
    from ..checkpoint.state import StateLayout, load_state

    path = explicit_checkpoint(cfg.checkpoint.load)
    meta = read_meta(path)
    layout = StateLayout(model, optimizer, pctx, cfg.model.vocab_size, cfg.optimizer.name)
    load_state(str(path), layout, reducer, None, False, None, lambda m: None, same_tp=meta["tp_size"] == 1)
    print(f"weights from {path} (step {meta['step']})", flush=True)


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

    def schedule(step: int) -> float:
        return lr_at(
            step,
            max_lr=1.0,
            min_lr=cfg.optimizer.min_lr / cfg.optimizer.lr,
            warmup_steps=t.warmup_steps,
            total_steps=total,
            style=t.lr_decay_style,
        )

    ctx = StepContext(
        sess.model, sess.grad_sync, opt, sess.pctx, cfg.optimizer.clip_grad, t.autocast_dtype, lr_schedule=schedule
    )
    losses, every, t0 = [], max(1, n // 10), time.perf_counter()
    for i in range(n):
        batches = train_micro_batches(sess.data.train, sess.consumed, cfg, sess.pctx)
        res = train_step(ctx, sess.step, batches)
        sess.consumed += t.global_batch_size
        sess.step += 1
        losses.append(res.loss)
        if (i + 1) % every == 0 or i + 1 == n:
            print(f"{label} step {i + 1}/{n}  loss {res.loss:.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return losses


def linear_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, weight) of every linear layer (column- and row-parallel, including the output layer)."""
    return [
        (f"{name}.weight", m.weight)
        for name, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]


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


def capture_geo(sess: Session, ranks: int, modules: dict, output_hooks: bool) -> Capture:
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
    return Capture(sess.step, names, grads, loss, A, S, time.perf_counter() - t0)


def capture_model(sess: Session, ranks: int, staleness: list[int], output_hooks: bool = False) -> tuple[dict, dict]:
    """Captures of every linear weight at t (now) and, after training on, at t + k for each k of
    ``staleness``: ``({k: Capture}, timings)``."""
    mods = dict(sess.model.named_modules())
    modules = {n: mods[n[: -len(".weight")]] for n, _ in linear_weights(sess.model)}
    caps = {0: capture_geo(sess, ranks, modules, output_hooks)}
    t0, timings = sess.step, {"train_between_captures_s": 0.0}
    for k in sorted(set(staleness)):
        ts = time.perf_counter()
        train_steps(sess, t0 + k - sess.step, label=f"staleness (to t+{k})")
        timings["train_between_captures_s"] += time.perf_counter() - ts
        caps[k] = capture_geo(sess, ranks, modules, output_hooks)
    timings["capture_s"] = sum(c.seconds for c in caps.values())
    return caps, timings
