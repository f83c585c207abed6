"""The training loop; reads top to bottom: data and the run's wiring (:mod:`.setup`, :func:`build_step_context`) ->
resume (:mod:`.checkpointing`) -> per step: batches, train step (:mod:`.step`), telemetry, metrics record,
non-finite handling, evaluation, progress, checkpoint and stop checks -> summary (:mod:`.summary`). The command
line and exit codes are in :mod:`.cli`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..config import Config
from ..model import count_parameters
from ..optim.schedule import lr_at
from ..parallel import ParallelContext
from . import telemetry
from .checkpointing import Checkpointer, DataFiles
from .data_setup import (
    DataBundle,
    build_data,
    resume_data,
    train_global_tokens,
    train_micro_batches,
    valid_micro_batches,
)
from .eta import RunTimer
from .log_line import StepOutput
from .metrics import MetricsLogger, StepRecords, open_run_outputs
from .profiling import StepProfiler
from .setup import build_model_and_optimizer, compile_model, startup_text
from .signals import StopRequest
from .step import StepContext, StepResult, evaluate, train_step
from .summary import RunStats, format_summary, nothing_to_do
from .validate import inert_notes


class NonFiniteGradientError(RuntimeError):
    """The global gradient norm was non-finite and ``train.nonfinite=stop``."""


def nonfinite_error(
    step: int, grad_norm: float, action: str, in_a_row: int = 1, max_in_a_row: int = 10**9
) -> NonFiniteGradientError | None:
    """The error that ends the run after step ``step`` (1-based) whose gradient norm is non-finite:
    ``action="stop"`` or ``in_a_row >= max_in_a_row`` (``train.max_skipped_steps``); None when the step is only
    skipped."""
    if action == "stop":
        return NonFiniteGradientError(
            f"step {step}: the gradient norm is {grad_norm} (non-finite) on every rank; stopping because "
            f"train.nonfinite=stop (set train.nonfinite=skip to skip such steps instead)"
        )
    if in_a_row >= max_in_a_row:
        return NonFiniteGradientError(
            f"step {step}: {in_a_row} consecutive steps had a non-finite gradient norm (train.max_skipped_steps="
            f"{max_in_a_row}); stopping. The last checkpoint holds the last good parameters; lower optimizer.lr or "
            f"check the data before resuming"
        )
    return None


def handle_nonfinite(
    step: int, grad_norm: float, action: str, reducer, in_a_row: int = 1, max_in_a_row: int = 10**9
) -> None:
    """What every rank does after a step whose (all-reduced, hence identical) gradient norm is non-finite.

    Raises :func:`nonfinite_error`'s error when there is one; otherwise (the update was already skipped) the
    reducer's error-feedback residuals, which may hold the non-finite values, are zeroed.
    """
    err = nonfinite_error(step, grad_norm, action, in_a_row, max_in_a_row)
    if err is not None:
        raise err
    reducer.reset_error_feedback()


def should_log(train, step: int) -> bool:
    """Step ``step`` (0-based) is a log step: every ``train.log_interval`` steps and the last one."""
    return (step + 1) % train.log_interval == 0 or step + 1 == train.steps


def should_eval(train, step: int, valid_batches: list) -> bool:
    """Step ``step`` (0-based) ends with an evaluation: there are validation batches, and it is an
    ``train.eval_interval`` step or the last one."""
    return bool(valid_batches) and ((step + 1) % train.eval_interval == 0 or step + 1 == train.steps)


def lr_scale(cfg: Config, step: int) -> float:
    """The learning rate of step ``step`` (0-based) as a fraction of ``optimizer.lr``."""
    t = cfg.train
    return lr_at(
        step,
        max_lr=1.0,
        min_lr=cfg.optimizer.min_lr / cfg.optimizer.lr,
        warmup_steps=t.warmup_steps,
        total_steps=t.steps,
        style=t.lr_decay_style,
    )


def build_step_context(cfg: Config, pctx: ParallelContext) -> StepContext:
    """The model (compiled with ``train.compile``), its gradient path and optimizer (:mod:`.setup`), the GeoFP8
    state (the reducer's) and the learning-rate schedule (:func:`lr_scale`): what every step of the run needs."""
    model, _, reducer, grad_sync, optimizer = build_model_and_optimizer(cfg, pctx)
    compile_model(cfg, model, pctx)
    return StepContext(
        model,
        grad_sync,
        optimizer,
        pctx,
        cfg.optimizer.clip_grad,
        cfg.train.autocast_dtype,
        geo=reducer.geo,
        lr_schedule=partial(lr_scale, cfg),
    )


def startup_lines(cfg: Config, pctx: ParallelContext, ctx: StepContext, data: DataBundle, n_params: int) -> list[str]:
    """What rank 0 prints before resuming: the run's layout (:func:`~.setup.startup_text`), the data, and the
    overrides this run's comm preset switches off (a sweep's shared override)."""
    return [
        startup_text(cfg, pctx, ctx.buckets, ctx.optimizer, n_params),
        *(f"data: {line}" for line in data.lines),
        *(f"config: {note}" for note in inert_notes(cfg)),
    ]


def nothing_to_do_line(start_step: int, steps: int) -> str:
    """The line of a launch whose checkpoint is at ``start_step`` >= ``train.steps`` (``steps``)."""
    return (
        f"nothing to do: the checkpoint is at step {start_step} and train.steps={steps}; to train on, relaunch "
        f"with a larger train.steps and checkpoint.allow_changes=train.steps (a longer schedule changes the "
        f"learning rate of the steps after {start_step})"
    )


@dataclass
class LoopState:
    """What the loop carries from step to step besides the model (made by :meth:`open` after resuming): the
    profiler, the metrics sinks and progress output, the validation batches, the stop request, the timer of
    evaluations and saves (for the ETA), the step records and the run's accumulators."""

    cfg: Config
    ctx: StepContext
    log: Callable[[str], None]
    start_step: int
    profiler: StepProfiler
    logger: MetricsLogger
    valid_batches: list[dict]
    output: StepOutput
    stop: StopRequest
    records: StepRecords
    timer: RunTimer
    stats: RunStats

    @classmethod
    def open(
        cls,
        cfg: Config,
        ctx: StepContext,
        ckpt: Checkpointer,
        data: DataBundle,
        start_step: int,
        skipped_in_a_row: int,
        log: Callable[[str], None],
    ) -> LoopState:
        """Start the profiler, open ``metrics.jsonl`` / wandb (a new timeline after a roll-back or a start from
        another checkpoint), read the validation batches and install the stop-signal handlers."""
        t, pctx = cfg.train, ctx.pctx
        # profiling.steps (1-based, as logged)
        profiler = StepProfiler(cfg, pctx, t.run_dir, log, start_step=start_step)
        logger = open_run_outputs(
            cfg, pctx, start_step, log, new_timeline=ckpt.start is not None and ckpt.start.kind in ("init", "rollback")
        )
        valid_batches = valid_micro_batches(data.valid, cfg, pctx) if data.valid and t.eval_batches else []
        output, stop, records = StepOutput(t, start_step, pctx.is_main), StopRequest(), StepRecords(cfg, pctx, ctx.geo)
        # measured evaluations and periodic saves: the ETA adds the ones still to come; a save's seconds go into the
        # next logged record (checkpoint_time_s, checkpoints_saved) for the metrics.jsonl watcher
        timer = RunTimer(
            t.steps,
            start_step,
            t.eval_interval if valid_batches else 0,
            cfg.checkpoint.interval,
            cfg.checkpoint.save_at_end,
        )
        stats = RunStats(start_step, skipped_in_a_row)
        return cls(cfg, ctx, log, start_step, profiler, logger, valid_batches, output, stop, records, timer, stats)

    def record(self, step: int, res: StepResult, dt: float, consumed: int, rel_err: dict) -> dict:
        """The metrics record of step ``step`` (0-based) made from its result ``res`` (``dt`` seconds, ``consumed``
        samples after it, the telemetry ``rel_err``); logs the step's GeoFP8 refresh (the run's first one always,
        then every 500 steps or every one with ``train.progress=false``)."""
        t, geo, stats = self.cfg.train, self.ctx.geo, self.stats
        refreshed = self.refreshed(step)
        if refreshed and geo is not None and (not stats.refresh_logged or t.progress is False or step % 500 == 0):
            stats.refresh_logged = True  # the first refresh of the run is always logged
            self.log(
                f"step {step + 1}: GeoFP8 refresh of {len(geo.selected)} layer(s) (rank {self.cfg.geo.rank}); "
                f"transform checksums equal on all {self.ctx.pctx.dp_size} DP ranks"
            )
        opt = self.ctx.optimizer
        # the parameter gather's bytes (its own key; comm_bytes is the gradient direction), and on log steps (the same
        # on every rank: a collective) the quantised gather's replica check and largest deviation
        gather = {"comm_gather_bytes": opt.reset_gather_bytes()}
        if should_log(t, step):
            gather.update(opt.gather_report())
        return self.records.make(
            step,
            res.lr_scale,
            res,
            dt,
            consumed,
            self.ctx.reducer.reset_bytes(),
            rel_err,
            stats.unlogged_saves(self.timer.durations["save"]),
            gather,
            refreshed=refreshed,
        )

    def nonfinite(self, step: int, res: StepResult, record: dict) -> NonFiniteGradientError | None:
        """Count a skipped step (``res.skipped``: the gradient norm was non-finite on every rank) and say so; the
        error that ends the run after it (its record is logged first), else None (the reducer's error-feedback
        residuals, which may hold the non-finite values, are zeroed)."""
        t, stats = self.cfg.train, self.stats
        if not stats.count_skip(res.skipped):
            return None
        record["loss"] = res.loss
        self.log(
            f"step {step + 1}: non-finite gradient norm ({res.grad_norm}); update skipped on all ranks "
            f"({stats.skipped_in_a_row} in a row)"
        )
        fatal = nonfinite_error(step + 1, res.grad_norm, t.nonfinite, stats.skipped_in_a_row, t.max_skipped_steps)
        if fatal is None:
            self.ctx.reducer.reset_error_feedback()  # the residuals may hold the non-finite values
        else:
            self.logger.log(record)
        return fatal

    def maybe_evaluate(self, step: int, record: dict) -> None:
        """On an evaluation step (:func:`should_eval`): the validation loss (timed), into ``record``."""
        if should_eval(self.cfg.train, step, self.valid_batches):
            self.ctx.optimizer.wait_param_gather()
            with self.timer.timing("eval"):
                self.stats.val_loss = evaluate(
                    self.ctx.model, self.valid_batches, self.ctx.pctx, self.cfg.train.autocast_dtype
                )
            record.update(eval_time_s=self.timer.last("eval"), val_loss=self.stats.val_loss)

    def refreshed(self, step: int) -> bool:
        """Step ``step`` (0-based) rebuilt the GeoFP8 transforms."""
        return self.ctx.geo is not None and self.ctx.geo.last_refresh == step

    def report(self, step: int, res: StepResult, record: dict, rel_err: dict) -> None:
        """Log the record of a step worth keeping (skipped, telemetry, GeoFP8 refresh, evaluation, log step),
        account the step and show the progress."""
        t, stats = self.cfg.train, self.stats
        keep = bool(res.skipped or rel_err or self.refreshed(step) or "val_loss" in record or should_log(t, step))
        if keep or step == self.start_step:  # the loss is read from the device on log steps only
            record["loss"] = res.loss
        if keep:
            self.logger.log(record)
            stats.saves_logged = len(self.timer.durations["save"])
        stats.add(step, record, res)
        self.output.step(record, should_log(t, step), stats, self.timer.phases())

    def close(self) -> None:
        """After the loop, also on an error."""
        self.profiler.close()  # a window still open (training ended inside it, or an error) is written
        self.ctx.optimizer.wait_param_gather()  # the model's parameters are complete when train() returns
        self.output.close()
        self.logger.close()  # before the handlers go: a launcher's SIGTERM during wandb's finish must not kill the rank
        self.stop.restore()


def train(cfg: Config, pctx: ParallelContext) -> dict:
    """Train up to ``train.steps`` steps (resuming from a checkpoint when there is one); returns the
    summary dict (also printed on rank 0).

    Raises:
        NonFiniteGradientError: ``train.nonfinite=stop`` or ``train.max_skipped_steps`` skips in a row
            (after saving a checkpoint of the last good state).
        StopRequested: SIGTERM/SIGUSR1 arrived (after saving a checkpoint).
    """
    t = cfg.train
    torch.manual_seed(t.seed)
    log = (lambda m: print(m, flush=True)) if pctx.is_main else (lambda m: None)
    data = build_data(cfg, pctx)
    ctx = build_step_context(cfg, pctx)
    n_params = count_parameters(cfg.model)
    for line in startup_lines(cfg, pctx, ctx, data, n_params):
        log(line)
    ckpt = Checkpointer(
        cfg,
        pctx,
        ctx.model,
        ctx.optimizer,
        ctx.reducer,
        ctx.geo,
        log,
        data_files=DataFiles(data.files, data.valid_files),
    )
    start_step, consumed, skipped_in_a_row = ckpt.resume()
    if start_step >= t.steps:  # nothing to train: write nothing (no checkpoint, metrics untouched)
        log(nothing_to_do_line(start_step, t.steps))
        return nothing_to_do(n_params, start_step, str(Path(t.run_dir).resolve()))
    # the checkpoint's index rule and blend position (a changed blend continues every component where it stopped)
    data, data_notes = resume_data(data, cfg, pctx, ckpt.meta, consumed)
    for line in data_notes:
        log(f"data: {line}")
    ckpt.data_record = data.record
    loop = LoopState.open(cfg, ctx, ckpt, data, start_step, skipped_in_a_row, log)
    try:
        for step in range(start_step, t.steps):
            loop.profiler.step_begin(step + 1)
            t0 = time.perf_counter()
            batches = train_micro_batches(data.train, consumed, cfg, pctx)
            measuring = telemetry.arm(ctx.reducer, step, cfg.comm.telemetry_interval)
            # the global token count comes from the sampler and the stop flags ride on the gradient-norm
            # all-reduce: nothing on the DP group runs between the previous step's parameter all-gathers and
            # this forward, and the step reads the device once (the norm), outside log steps
            global_tokens = train_global_tokens(data.train, consumed, cfg)
            res = train_step(ctx, step, batches, global_tokens=global_tokens, stop_flags=loop.stop.flags)
            stopping = loop.stop.agree(res.stop_flags)
            rel_err = telemetry.collect(ctx.reducer, pctx.dp_group, pctx.dp_size) if measuring else {}
            consumed += t.global_batch_size
            record = loop.record(step, res, time.perf_counter() - t0, consumed, rel_err)
            fatal = loop.nonfinite(step, res, record)
            if fatal is None:
                loop.maybe_evaluate(step, record)
                loop.report(step, res, record, rel_err)
            loop.profiler.step_end(step + 1)
            stop_signal = loop.stop.signal if stopping else None
            if ckpt.maybe_save(step + 1, consumed, loop.stats.skipped_in_a_row, stop_signal, fatal, loop.timer):
                break  # train.exit_interval
    finally:
        loop.close()
    summary = loop.stats.summary(n_params, str(Path(t.run_dir).resolve()), ckpt.last_path, cfg.comm.label)
    log(format_summary(summary, cfg))
    return summary
