"""One optimizer step: forward/backward over the micro-batches, DP reduction, clipping, update.

The loss is the sum of per-token losses over all valid tokens of the global batch divided by the
global valid-token count (``docs/design.md``, "Invariants of the reduction path", 10). Each rank scales its
local sum by ``dp_size / global_tokens`` so that the reducer's single FP32 division by ``dp_size`` yields exactly
the gradient of that global mean, however unevenly tokens fall on ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import Bucket, DistributedOptimizer, GradSync
from ..parallel import ParallelContext
from ..parallel import collectives as C
from ..parallel.trace import trace_range

if TYPE_CHECKING:
    from ..geometry import GeoState


@dataclass
class StepContext:
    """What every optimizer step needs, built once before the loop (in training by
    :func:`~.trainer.build_step_context`): the model, its gradient path and optimizer, the parallel layout, and the
    per-run settings of a step.

    ``clip_grad``: the global gradient-norm clip (``optimizer.clip_grad``; 0 clips nothing); ``autocast_dtype``:
    ``train.autocast_dtype``; ``geo``: the GeoFP8 state, if any (the reducer's); ``lr_schedule``: step (0-based)
    -> learning rate as a fraction of ``optimizer.lr`` (None: 1.0 on every step).
    """

    model: torch.nn.Module
    grad_sync: GradSync
    optimizer: DistributedOptimizer
    pctx: ParallelContext
    clip_grad: float
    autocast_dtype: str = "auto"
    geo: GeoState | None = None
    lr_schedule: Callable[[int], float] | None = None

    @property
    def reducer(self):
        """The gradient reducer (codec, error feedback, telemetry, byte counts) of :attr:`grad_sync`."""
        return self.grad_sync.reducer

    @property
    def buckets(self) -> list[Bucket]:
        """The bucketed gradient buffers of :attr:`grad_sync`."""
        return self.grad_sync.buckets

    def lr_scale(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based) as a fraction of ``optimizer.lr``."""
        return 1.0 if self.lr_schedule is None else self.lr_schedule(step)


@dataclass
class StepResult:
    """What one step returns. ``loss`` is read from the device only when first asked for (one host sync, on
    log steps); ``grad_norm`` is the step's single host read (the skip / clip decision)."""

    loss_sum: torch.Tensor  # float64 [] on the device: sum of per-token losses over the global batch (nats)
    grad_norm: float  # global L2 norm before clipping
    tokens: int  # valid tokens in the global batch
    skipped: bool  # True when the gradient was not finite and no update was made
    stop_flags: list[float] = field(default_factory=list)  # ``stop_flags`` summed over all ranks (see train_step)
    lr_scale: float = 1.0  # the step's learning rate as a fraction of ``optimizer.lr`` (StepContext.lr_scale)

    @property
    def loss(self) -> float:
        """Global mean per-token loss (nats); the first access waits for the device."""
        if not hasattr(self, "_loss"):
            self._loss = float(self.loss_sum.item()) / max(self.tokens, 1)
        return self._loss


def autocast_context(pctx: ParallelContext, autocast_dtype: str):
    """BF16 autocast on CUDA (``auto`` or ``bf16``); nothing on CPU or with ``none``."""
    if pctx.device.type == "cuda" and autocast_dtype in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


DOCUMENT_KEYS = ("position_ids", "segment_ids")


def document_inputs(mb: dict, device: torch.device) -> dict:
    """The micro-batch's optional per-document model inputs (``position_ids``, ``segment_ids`` int64 ``[m, s]``,
    present with ``data.reset_position_ids`` / ``data.reset_attention_mask``) on ``device``, as keyword arguments
    of the model's forward."""
    return {k: mb[k].to(device, non_blocking=True) for k in DOCUMENT_KEYS if k in mb}


def train_step(
    ctx: StepContext,
    step: int,
    micro_batches: list[dict],
    *,
    global_tokens: int | None = None,
    stop_flags: list[float] | Callable[[], list[float]] | None = None,
) -> StepResult:
    """Run optimizer step ``step`` (0-based) over this rank's ``micro_batches`` (dicts of ``tokens``, ``labels``
    int64 ``[m, s]`` and ``loss_mask`` float ``[m, s]``, optionally ``position_ids`` / ``segment_ids``) and update
    the parameters of ``ctx.model`` at the learning rate ``ctx.lr_scale(step)`` unless the gradient is non-finite.

    ``global_tokens``: the valid-token count of the whole global batch (all DP ranks), known on the host from
    the sampler. Pass it in training: otherwise it is all-reduced over the DP group here, a collective plus a
    host read that queue behind the previous step's asynchronous parameter all-gathers and so undo their
    overlap with this forward.

    ``stop_flags``: host numbers (a list, or a function returning one, called just before the gradient norm)
    summed over all ranks in the same collective as the gradient norm (the stop request's per-signal counts),
    returned as ``StepResult.stop_flags``; the step makes one host read either way.

    With ``ctx.geo`` (a :class:`~megatron_geo.geometry.GeoState`) on a refresh step, the input statistics
    are collected in the first micro-batch's forward and the transforms rebuilt after backward, before
    any bucket is reduced (those reductions are deferred to the end of backward on that step only).
    """
    model, grad_sync, optimizer, pctx = ctx.model, ctx.grad_sync, ctx.optimizer, ctx.pctx
    geo: Any = ctx.geo  # not None wherever ``refresh`` is True
    lr_scale, clip_grad = ctx.lr_scale(step), ctx.clip_grad
    dev = pctx.device
    if global_tokens is None:
        local_tokens = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)  # host tensors: no device sync
        count = torch.tensor([local_tokens], dtype=torch.float64, device=dev)
        C.all_reduce(count, pctx.dp_group)
        global_tokens = int(count.item())
    scale = pctx.dp_size / max(float(global_tokens), 1.0)

    refresh = geo is not None and geo.is_refresh_step(step)
    grad_sync.start_step(defer=refresh)
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    for i, mb in enumerate(micro_batches):
        grad_sync.set_last_micro_batch(i == len(micro_batches) - 1)
        tokens, labels, mask = (mb[k].to(dev, non_blocking=True) for k in ("tokens", "labels", "loss_mask"))
        if refresh and i == 0:
            geo.arm()
        with autocast_context(pctx, ctx.autocast_dtype):
            per_token = model(tokens, labels, **document_inputs(mb, dev))
        if refresh and i == 0:
            geo.disarm()
        masked = (per_token * mask).sum()
        (masked * scale).backward()
        loss_sum += masked.detach().double()
    if refresh:
        with trace_range("transform"):  # statistics reduce, eigendecomposition, new transforms
            geo.refresh(step)
    grad_sync.finish()
    if geo is not None:
        geo.end_profiled_step()

    C.all_reduce(loss_sum, pctx.dp_group)  # NCCL: the stream waits, not the host; read on log steps only
    if stop_flags is None:
        norm, flags = optimizer.grad_norm(), []
    else:
        norm, flags = optimizer.grad_norm(extra=stop_flags() if callable(stop_flags) else list(stop_flags))
    skipped = not math.isfinite(norm)
    if grad_sync.early_updates is not None:
        grad_sync.early_updates.observe(norm, clip_grad)  # drops early Muon updates that a clip or skip invalidates
    if not skipped:
        optimizer.clip(norm, clip_grad)
        optimizer.step(lr_scale)
    return StepResult(loss_sum, norm, int(global_tokens), skipped, flags, lr_scale)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, micro_batches: list[dict], pctx: ParallelContext, autocast_dtype: str = "auto"
) -> float:
    """Mean per-token validation loss over all ranks' ``micro_batches`` (nats)."""
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=pctx.device)
    for mb in micro_batches:
        tokens, labels, mask = (mb[k].to(pctx.device) for k in ("tokens", "labels", "loss_mask"))
        with autocast_context(pctx, autocast_dtype):
            per_token = model(tokens, labels, **document_inputs(mb, pctx.device))
        acc[0] += (per_token * mask).sum().double()
        acc[1] += mask.sum().double()
    C.all_reduce(acc, pctx.dp_group)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()
