"""The training loop; reads top to bottom: data and the run's wiring (:mod:`.setup`) -> resume (:mod:`.checkpointing`)
-> per step: train step, telemetry, non-finite handling, evaluation, metrics record, progress, checkpoint -> summary
(:mod:`.summary`). The command line and exit codes are in :mod:`.cli`."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..model import count_parameters
from ..optim.schedule import lr_at
from ..parallel import ParallelContext
from . import telemetry
from .checkpointing import Checkpointer
from .data_setup import build_data, resume_data, train_global_tokens, train_micro_batches, valid_micro_batches
from .eta import RunTimer
from .log_line import StepOutput
from .metrics import StepRecords, open_run_outputs
from .profiling import StepProfiler
from .setup import build_model_and_optimizer, compile_model, startup_text
from .signals import StopRequest
from .step import evaluate, train_step
from .summary import RunStats, format_summary, nothing_to_do
from .validate import reject_inert_keys


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
    model, buckets, reducer, grad_sync, optimizer = build_model_and_optimizer(cfg, pctx)
    geo = reducer.geo
    compile_model(cfg, model, pctx)
    n_params = count_parameters(cfg.model)
    log(startup_text(cfg, pctx, buckets, optimizer, n_params))
    for line in data.lines:
        log(f"data: {line}")
    for note in reject_inert_keys(cfg):  # a sweep's shared override that this run's comm preset switches off
        log(f"config: {note}")
    ckpt = Checkpointer(
        cfg, pctx, model, optimizer, reducer, geo, log, data_files=data.files, valid_files=data.valid_files
    )
    start_step, consumed, skipped_in_a_row = ckpt.resume()
    if start_step >= t.steps:  # nothing to train: write nothing (no checkpoint, metrics untouched)
        log(
            f"nothing to do: the checkpoint is at step {start_step} and train.steps={t.steps}; to train on, relaunch "
            f"with a larger train.steps and checkpoint.allow_changes=train.steps (a longer schedule changes the "
            f"learning rate of the steps after {start_step})"
        )
        return nothing_to_do(n_params, start_step, str(Path(t.run_dir).resolve()))
    # the checkpoint's index rule and blend position (a changed blend continues every component where it stopped)
    data, data_notes = resume_data(data, cfg, pctx, ckpt.meta, consumed)
    for line in data_notes:
        log(f"data: {line}")
    ckpt.data_record = data.record
    profiler = StepProfiler(cfg, pctx, t.run_dir, log, start_step=start_step)  # profiling.steps (1-based, as logged)
    logger = open_run_outputs(
        cfg, pctx, start_step, log, new_timeline=ckpt.start is not None and ckpt.start.kind in ("init", "rollback")
    )
    valid_batches = valid_micro_batches(data.valid, cfg, pctx) if data.valid and t.eval_batches else []
    output, stop, records = StepOutput(t, start_step, pctx.is_main), StopRequest(), StepRecords(cfg, pctx, geo)
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
    try:
        for step in range(start_step, t.steps):
            profiler.step_begin(step + 1)
            t0 = time.perf_counter()
            batches, scale = train_micro_batches(data.train, consumed, cfg, pctx), lr_scale(cfg, step)
            measuring = telemetry.arm(reducer, step, cfg.comm.telemetry_interval)
            # the global token count comes from the sampler and the stop flags ride on the gradient-norm
            # all-reduce: nothing on the DP group runs between the previous step's parameter all-gathers and
            # this forward, and the step reads the device once (the norm), outside log steps
            res = train_step(
                model,
                batches,
                grad_sync,
                optimizer,
                pctx,
                scale,
                cfg.optimizer.clip_grad,
                t.autocast_dtype,
                geo=geo,
                step=step,
                global_tokens=train_global_tokens(data.train, consumed, cfg),
                stop_flags=stop.flags,
            )
            stopping = stop.agree(res.stop_flags)
            rel_err = telemetry.collect(reducer, pctx.dp_group, pctx.dp_size) if measuring else {}
            consumed += t.global_batch_size
            dt = time.perf_counter() - t0
            refreshed = geo is not None and geo.last_refresh == step
            if refreshed and (not stats.refresh_logged or t.progress is False or step % 500 == 0):
                stats.refresh_logged = True  # the first refresh of the run is always logged
                log(
                    f"step {step + 1}: GeoFP8 refresh of {len(geo.selected)} layer(s) (rank {cfg.geo.rank}); "
                    f"transform checksums equal on all {pctx.dp_size} DP ranks"
                )
            record = records.make(
                step,
                scale,
                res,
                dt,
                consumed,
                reducer.reset_bytes(),
                rel_err,
                stats.unlogged_saves(timer.durations["save"]),
                refreshed=refreshed,
            )
            fatal = None
            if stats.count_skip(res.skipped):
                record["loss"] = res.loss
                log(
                    f"step {step + 1}: non-finite gradient norm ({res.grad_norm}); update skipped on all ranks "
                    f"({stats.skipped_in_a_row} in a row)"
                )
                fatal = nonfinite_error(
                    step + 1, res.grad_norm, t.nonfinite, stats.skipped_in_a_row, t.max_skipped_steps
                )
                if fatal is None:
                    reducer.reset_error_feedback()  # the residuals may hold the non-finite values
                else:
                    logger.log(record)
            if fatal is None:
                if should_eval(t, step, valid_batches):
                    optimizer.wait_param_gather()
                    with timer.timing("eval"):
                        stats.val_loss = evaluate(model, valid_batches, pctx, t.autocast_dtype)
                    record.update(eval_time_s=timer.last("eval"), val_loss=stats.val_loss)
                keep = bool(res.skipped or rel_err or refreshed or "val_loss" in record or should_log(t, step))
                if keep or step == start_step:  # the loss is read from the device on log steps only
                    record["loss"] = res.loss
                if keep:
                    logger.log(record)
                    stats.saves_logged = len(timer.durations["save"])
                stats.add(step, record, res)
                output.step(record, should_log(t, step), stats, timer.phases())
            profiler.step_end(step + 1)
            if ckpt.maybe_save(
                step + 1, consumed, stats.skipped_in_a_row, stop.signal if stopping else None, fatal, timer
            ):
                break
    finally:
        profiler.close()  # a window still open (training ended inside it, or an error) is written
        optimizer.wait_param_gather()  # the model's parameters are complete when train() returns
        output.close()
        logger.close()  # before the handlers go: a launcher's SIGTERM during wandb's finish must not kill the rank
        stop.restore()
    summary = stats.summary(n_params, str(Path(t.run_dir).resolve()), ckpt.last_path, cfg.comm.label)
    log(format_summary(summary, cfg))
    return summary
