"""The training entry point; reads top to bottom: config -> parallel context -> data -> model ->
gradient buffers, reducer and optimizer -> loop (train step, eval, metrics) -> summary."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.manager import CheckpointSaveError
from ..comm import build_reducer
from ..config import Config, ConfigError, config_to_dict, dump_config, load_config, validate_config
from ..config.validate import check_inputs, parse_power, parse_power_search
from ..distributed import DistributedOptimizer, GradSync, build_buckets
from ..distributed.shard_plan import ADAMW_FLOPS_PER_ELEMENT, newton_schulz_flops
from ..geometry import GeoState
from ..model import Llama, count_parameters, flops_per_token
from ..parallel import LaunchError, ParallelContext, destroy_parallel, detect_launch_env, init_parallel
from .data_setup import build_data, train_global_tokens, train_micro_batches, valid_micro_batches
from .checkpointing import Checkpointer
from . import telemetry
from .eta import RunTimer
from .log_line import log_line, use_progress_bar
from .metrics import MetricsLogger
from .mfu import gpu_flops_metrics
from .schedule import lr_at
from .signals import StopRequest
from .step import evaluate, train_step


class NonFiniteGradientError(RuntimeError):
    """The global gradient norm was non-finite and ``train.nonfinite=stop``."""


def handle_nonfinite(step: int, grad_norm: float, action: str, reducer, in_a_row: int = 1,
                     max_in_a_row: int = 10**9) -> None:
    """What every rank does after a step whose (all-reduced, hence identical) gradient norm is non-finite.

    ``action="stop"`` or ``in_a_row >= max_in_a_row`` raises :class:`NonFiniteGradientError`; otherwise
    (the update was already skipped) the reducer's error-feedback residuals, which may hold the
    non-finite values, are zeroed.
    """
    if action == "stop":
        raise NonFiniteGradientError(
            f"step {step}: the gradient norm is {grad_norm} (non-finite) on every rank; stopping because "
            f"train.nonfinite=stop (set train.nonfinite=skip to skip such steps instead)")
    if in_a_row >= max_in_a_row:
        raise NonFiniteGradientError(
            f"step {step}: {in_a_row} consecutive steps had a non-finite gradient norm (train.max_skipped_steps="
            f"{max_in_a_row}); stopping. The last checkpoint holds the last good parameters; lower optimizer.lr or "
            f"check the data before resuming")
    reset = getattr(reducer, "reset_error_feedback", None)
    if reset is not None:
        reset()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pretrain a Llama with TP x DP and pluggable gradient reduction.",
                                epilog="Overrides: section.key=value, e.g. train.steps=20 comm.dtype=bf16")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config; repeat to merge several in order (e.g. a model file, then a comm preset)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="dotted section.key=value overrides applied last")
    return p.parse_intermixed_args(argv)  # --config may come after overrides too


def _log0(pctx: ParallelContext, msg: str) -> None:
    if pctx.is_main:
        print(msg, flush=True)


def build_geo(cfg: Config, model: torch.nn.Module, pctx: ParallelContext) -> GeoState:
    """GeoFP8 state for ``comm.transform=geo`` (a bad ``geo.layers`` pattern is a ConfigError)."""
    g, auto = cfg.geo, cfg.geo.select in ("auto", "gain")
    e5m2 = cfg.comm.dtype == "fp8_e5m2"
    search, power = parse_power_search(g.power_search), parse_power(g.power)
    if search and power != 0.5:
        _log0(pctx, f"note: geo.power={g.power} is not used: geo.power_search={g.power_search} chooses the power "
                    f"per layer at every refresh")
    try:
        return GeoState(model, g.layers, g.rank, g.damping, g.refresh_interval, g.ef_on_refresh, pctx.dp_group,
                        auto_layers=g.num_layers if auto else 0, profile_steps=g.profile_steps if auto else 0,
                        fp8_max=57344.0 if e5m2 else 448.0,
                        underflow_below=2.0 ** -17 if e5m2 else 2.0 ** -10,  # half the smallest subnormal
                        log=lambda m: _log0(pctx, m), statistics=g.statistics, sketch_size=g.sketch_size,
                        power=power, power_search=search, select_gain=g.select == "gain")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def optimizer_flops_fn(optimizer_name: str):
    """``param -> optimizer FLOPs per step`` (Newton-Schulz for Muon matrices, element-wise otherwise)."""
    def flops(p: torch.nn.Parameter) -> float:
        if optimizer_name == "muon" and getattr(p, "use_muon", False):
            return newton_schulz_flops(tuple(p.shape))
        return ADAMW_FLOPS_PER_ELEMENT * p.numel()
    return flops


def build_model_and_optimizer(cfg: Config, pctx: ParallelContext):
    """Model on the device, its bucketed gradient path, reducer and distributed optimizer."""
    dtype = torch.bfloat16 if cfg.train.param_dtype == "bf16" else torch.float32
    model = Llama(cfg.model, pctx.tp_group, cfg.train.seed, dtype=dtype, device=pctx.device)
    muon = cfg.optimizer.name == "muon"
    geo = build_geo(cfg, model, pctx) if cfg.comm.transform == "geo" else None
    geo_ids = {id(p) for p in geo.params.values()} if geo else set()
    reducer = build_reducer(cfg.comm, pctx.dp_group, pctx.dp_size, pctx.dp_rank, seed=cfg.train.seed,
                            device=pctx.device)
    sharded = cfg.parallel.distributed_optimizer
    # Muon matrices are owned whole; GeoFP8 layers under AdamW by whole rows (G T mixes columns only)
    buckets = build_buckets(list(model.named_parameters()), cfg.parallel.bucket_size, pctx.dp_size,
                            atomic_fn=lambda p: sharded and muon and getattr(p, "use_muon", False),
                            align=reducer.alignment(), flops_fn=optimizer_flops_fn(cfg.optimizer.name),
                            granule_fn=lambda p: p.shape[1] if sharded and id(p) in geo_ids else 1)
    for b in buckets:
        reducer.register_bucket(b.index, b.plan.offsets, [p.numel() for p in b.params], b.plan.bounds, pctx.device)
    if geo is not None:
        reducer.attach_geo(geo, buckets)
    grad_sync = GradSync(buckets, reducer, sharded=sharded, overlap=cfg.parallel.overlap_grad_reduce)
    overlap = cfg.parallel.overlap_param_gather
    overlap = pctx.device.type == "cuda" if overlap == "auto" else overlap == "true"
    optimizer = DistributedOptimizer(buckets, cfg.optimizer, pctx, sharded=sharded, overlap_param_gather=overlap)
    optimizer.register_forward_hooks(model)
    return model, buckets, reducer, grad_sync, optimizer


class StopRequested(Exception):
    """A stop signal arrived; a checkpoint was saved (exit code 4)."""


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
    run_dir = Path(t.run_dir)

    data = build_data(cfg, pctx)
    model, buckets, reducer, grad_sync, optimizer = build_model_and_optimizer(cfg, pctx)
    geo = getattr(reducer, "geo", None)
    if t.compile:
        from ..model.compile import compile_blocks

        compile_blocks(model, backend="inductor" if pctx.device.type == "cuda" else "eager")
    n_params = count_parameters(cfg.model)
    flops_tok = flops_per_token(cfg.model)
    gpu_name = torch.cuda.get_device_name(pctx.device) if pctx.device.type == "cuda" else None
    pad = sum(b.plan.padding([p.numel() for p in b.params]) for b in buckets)
    uneven = sum(1 for b in buckets if not b.plan.even)
    _log0(pctx, f"parameters: {n_params:,}")
    _log0(pctx, f"parallel: world={pctx.world_size} TP={pctx.tp_size} DP={pctx.dp_size} backend={pctx.backend} "
                f"device={pctx.device} | {len(buckets)} buckets ({uneven} with uneven owner ranges), shard padding {pad} "
                f"elements | "
                f"comm={cfg.comm.label} (comm.dtype={cfg.comm.dtype}) "
                f"distributed_optimizer={cfg.parallel.distributed_optimizer} "
                f"overlap_param_gather={optimizer.overlap_param_gather}")
    if pctx.dp_size == 1 and (cfg.comm.dtype != "fp32" or cfg.comm.transform != "none"):
        _log0(pctx, f"note: DP=1: no gradient is sent between data-parallel ranks, so comm={cfg.comm.label} "
                    f"(comm.dtype={cfg.comm.dtype}, comm.transform={cfg.comm.transform}) changes nothing in this run; "
                    f"launch several data-parallel ranks to compare communication modes")
    ckpt = Checkpointer(cfg, pctx, model, optimizer, reducer, geo, lambda m: _log0(pctx, m))
    start_step, consumed, skipped_in_a_row = ckpt.resume()
    if start_step >= t.steps:  # nothing to train: write nothing (no checkpoint, metrics untouched)
        _log0(pctx, f"nothing to do: the checkpoint is at step {start_step} and train.steps={t.steps}; raise "
                    f"train.steps to train on")
        return {"parameters": n_params, "steps": start_step, "start_loss": None, "final_loss": None,
                "val_loss": None, "tokens_per_sec": 0.0, "comm_bytes_per_step": 0.0,
                "run_dir": str(run_dir.resolve()), "checkpoint": None, "start_step": start_step}
    if pctx.is_main:  # only once the checkpoint (if any) loaded: a failed start leaves the run dir as it was
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(launch_neutral(cfg)))

    label = cfg.comm.label
    tags = [f"comm={label}", f"comm.dtype={cfg.comm.dtype}", f"opt={cfg.optimizer.name}", f"tp={pctx.tp_size}",
            f"dp={pctx.dp_size}"]
    logger = MetricsLogger(str(run_dir), pctx.is_main, cfg.logging.wandb, cfg.logging.wandb_project,
                           cfg.logging.wandb_group or label, cfg.logging.wandb_name or f"{label}-seed{t.seed}", tags,
                           config_to_dict(cfg), resume_step=start_step, wandb_resume=cfg.logging.wandb_resume,
                           log=lambda m: _log0(pctx, m))
    valid_batches = valid_micro_batches(data.valid, cfg, pctx) if data.valid and t.eval_batches else []
    progress = None
    if pctx.is_main and use_progress_bar(t.progress, sys.stdout):  # a log file gets lines, not \r updates
        from tqdm import tqdm

        progress = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stdout)
    stop = StopRequest()
    every = cfg.checkpoint.interval
    # measured evaluations and periodic saves: the ETA adds the ones still to come; a save's seconds go into the
    # next logged record (checkpoint_time_s, checkpoints_saved) for the metrics.jsonl watcher
    timer = RunTimer(t.steps, start_step, t.eval_interval if valid_batches else 0, every, cfg.checkpoint.save_at_end)
    unlogged_saves: list[float] = []

    first_loss, last, last_res, val_loss, logged_refresh, skipped_total = None, None, None, None, False, 0
    tok_per_s_hist, bytes_hist, step_times = [], [], []
    try:
        for step in range(start_step, t.steps):
            t0 = time.perf_counter()
            batches = train_micro_batches(data.train, consumed, cfg, pctx)
            scale = lr_at(step, max_lr=1.0, min_lr=cfg.optimizer.min_lr / cfg.optimizer.lr,
                          warmup_steps=t.warmup_steps, total_steps=t.steps, style=t.lr_decay_style)
            measuring = telemetry.arm(reducer, step, cfg.comm.telemetry_interval)
            # the global token count comes from the sampler and the stop flags ride on the gradient-norm
            # all-reduce: nothing on the DP group runs between the previous step's parameter all-gathers and
            # this forward, and the step reads the device once (the norm), outside log steps
            res = train_step(model, batches, grad_sync, optimizer, pctx, scale, cfg.optimizer.clip_grad,
                             t.autocast_dtype, geo=geo, step=step,
                             global_tokens=train_global_tokens(data.train, consumed, cfg), stop_flags=stop.flags)
            stopping = stop.agree(res.stop_flags)
            rel_err = telemetry.collect(reducer, pctx.dp_group, pctx.dp_size) if measuring else {}
            consumed += t.global_batch_size
            dt = time.perf_counter() - t0
            refreshed = geo is not None and geo.last_refresh == step
            if refreshed and (not logged_refresh or t.progress is False or step % 500 == 0):
                logged_refresh = True  # the first refresh of the run is always logged
                _log0(pctx, f"step {step + 1}: GeoFP8 refresh of {len(geo.selected)} layer(s) (rank {cfg.geo.rank}); "
                            f"transform checksums equal on all {pctx.dp_size} DP ranks")
            comm_bytes = reducer.reset_bytes()
            record = {"step": step + 1, "lr": cfg.optimizer.lr * scale, "grad_norm": res.grad_norm,
                      "tokens_per_sec": res.tokens / dt, "comm_bytes": comm_bytes, "step_time_s": dt,
                      "consumed_samples": consumed, "skipped": res.skipped}
            record.update(rel_err)
            if unlogged_saves:
                record.update(checkpoint_time_s=sum(unlogged_saves), checkpoints_saved=len(unlogged_saves))
            if geo is not None:
                record["geo_refresh"] = refreshed
                if refreshed:  # per-layer refresh diagnostics (host floats, read once at the refresh)
                    record.update({f"geo/{n.removesuffix('.weight')}/{k}": v
                                   for n, d in geo.diagnostics.items() for k, v in d.items()})
            if gpu_name is not None:  # MFU and memory (DESIGN.md section 5 metrics)
                fl = gpu_flops_metrics(record["tokens_per_sec"], pctx.world_size, flops_tok, gpu_name)
                record.update(tflops_per_gpu=fl["tflops_per_gpu"], mfu=fl["mfu"],
                              max_memory_gib=torch.cuda.max_memory_allocated(pctx.device) / 2**30)
            skipped_in_a_row = skipped_in_a_row + 1 if res.skipped else 0
            if res.skipped:
                record["loss"] = res.loss
                _log0(pctx, f"step {step + 1}: non-finite gradient norm ({res.grad_norm}); update skipped on all "
                            f"ranks ({skipped_in_a_row} in a row)")
                if t.nonfinite == "stop" or skipped_in_a_row >= t.max_skipped_steps:
                    logger.log(record)
                    ckpt.save(step + 1, consumed, skipped_in_a_row)  # the parameters are the last good state
                handle_nonfinite(step + 1, res.grad_norm, t.nonfinite, reducer, skipped_in_a_row, t.max_skipped_steps)
            if valid_batches and ((step + 1) % t.eval_interval == 0 or step + 1 == t.steps):
                optimizer.wait_param_gather()
                with timer.timing("eval"):
                    val_loss = evaluate(model, valid_batches, pctx, t.autocast_dtype)
                record["eval_time_s"] = timer.last("eval")
                record["val_loss"] = val_loss
            log_now = bool(res.skipped or rel_err or refreshed or (step + 1) % t.log_interval == 0
                           or "val_loss" in record or step + 1 == t.steps or first_loss is None)
            if log_now:  # the loss is read from the device on log steps only
                record["loss"] = res.loss
            if res.skipped or rel_err or refreshed or ((step + 1) % t.log_interval == 0 or "val_loss" in record
                                          or step + 1 == t.steps):
                logger.log(record)
                unlogged_saves.clear()
            first_loss = res.loss if first_loss is None else first_loss
            last, last_res = record, res
            if step > start_step:
                tok_per_s_hist.append(record["tokens_per_sec"])
                step_times.append(dt)

            skipped_total += int(res.skipped)
            if progress is None and ((step + 1) % t.log_interval == 0 or step + 1 == t.steps):
                _log0(pctx, log_line(record, t.steps, step_times[-20:], skipped_total, timer.phases()))  # one line
            bytes_hist.append(comm_bytes)
            if progress is not None:
                progress.update(1)
                if log_now:
                    progress.set_postfix(loss=f"{res.loss:.3f}", **({"val": f"{val_loss:.3f}"} if val_loss else {}))
            if every and (step + 1) % every == 0:
                with timer.timing("save"):
                    ckpt.save(step + 1, consumed, skipped_in_a_row)
                unlogged_saves.append(timer.last("save"))
            if t.exit_interval and (step + 1) % t.exit_interval == 0 and step + 1 < t.steps:
                ckpt.save(step + 1, consumed, skipped_in_a_row)
                _log0(pctx, f"step {step + 1}: exiting (train.exit_interval={t.exit_interval}); {resume_hint(cfg)}")
                break
            if stopping:
                ckpt.save(step + 1, consumed, skipped_in_a_row)
                raise StopRequested(f"stopped by signal {stop.signal} after step {step + 1}; checkpoint saved to "
                                    f"{ckpt.root}; {resume_hint(cfg)}")
        else:
            if cfg.checkpoint.save_at_end and t.steps > 0:
                ckpt.save(t.steps, consumed, skipped_in_a_row)
    finally:
        optimizer.wait_param_gather()  # the model's parameters are complete when train() returns
        if progress is not None:
            progress.close()
        logger.close()  # before the handlers go: a launcher's SIGTERM during wandb's finish must not kill the rank
        stop.restore()
    summary = {
        "parameters": n_params, "steps": last["step"], "start_loss": first_loss, "final_loss": last_res.loss,
        "val_loss": val_loss,
        "tokens_per_sec": sum(tok_per_s_hist) / len(tok_per_s_hist) if tok_per_s_hist else last["tokens_per_sec"],
        "comm_bytes_per_step": sum(bytes_hist) / len(bytes_hist), "run_dir": str(run_dir.resolve()),
        "checkpoint": ckpt.last_path, "comm": cfg.comm.label, "start_step": start_step,
    }
    _log0(pctx, format_summary(summary, cfg))
    return summary


def resume_hint(cfg: Config) -> str:
    """How to continue this run from the checkpoint just saved."""
    if cfg.checkpoint.load == "none":
        return ("relaunch with checkpoint.load=auto to resume (checkpoint.load=none starts this folder over at every "
                "launch)")
    return "relaunch with the same train.run_dir to resume"


def launch_neutral(cfg: Config) -> Config:
    """``cfg`` as the run's record (``config.yaml``, checkpoint metadata): without the one-launch permission
    ``checkpoint.allow_changes``, so a reloaded config never carries it into later resumes."""
    import dataclasses

    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, allow_changes=""))


def format_summary(s: dict, cfg: Config) -> str:
    val = f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "n/a"
    return "\n".join([
        "=" * 72,
        f"summary: {s['steps']} steps{'' if s['steps'] == cfg.train.steps else f' of train.steps={cfg.train.steps}'}, "
        f"{s['parameters']:,} parameters, comm={cfg.comm.label} (comm.dtype={cfg.comm.dtype})",
        f"  train loss      {s['start_loss']:.4f} (step {s.get('start_step', 0) + 1}"
        f"{', first of this run' if s.get('start_step') else ', first step'}) -> {s['final_loss']:.4f} (last step)",
        f"  validation loss {val}",
        f"  throughput      {s['tokens_per_sec']:,.1f} tokens/s (global"
        f"{', excluding the first step' if s['steps'] > 1 else ''})",
        f"  DP grad comm    {s['comm_bytes_per_step']:,.0f} bytes sent per step per rank",
        f"  outputs         {s['run_dir']}/ (config.yaml, metrics.jsonl"
        f"{', wandb/' if cfg.logging.wandb != 'disabled' else ''})",
        *([f"  checkpoint      {s['checkpoint']} ({resume_hint(cfg)})"]
          if s.get("checkpoint") else []),
        "=" * 72,
    ])


def prepare_output_dirs(cfg: Config) -> None:
    """Create ``train.run_dir`` and the checkpoint folder before any work, so that an unwritable place is
    a start-up error (exit 2) and not a failure at the first save.

    Raises:
        ConfigError: a folder cannot be created or written (names the key and the path).
    """
    from ..checkpoint.manager import checkpoint_root

    for key, path in (("train.run_dir", Path(cfg.train.run_dir)),
                      ("checkpoint.dir" if cfg.checkpoint.dir else "train.run_dir (its checkpoints/)",
                       checkpoint_root(cfg))):
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"{key}: cannot create or write {str(path)!r} ({e.strerror or e}); choose a writable "
                              f"folder") from None


def _is_collective_failure(e: BaseException) -> bool:
    """gloo reports a dead peer or a timeout as a plain RuntimeError from its transport."""
    msg = str(e)
    return any(k in msg for k in ("gloo", "Connection reset", "Connection closed", "Timed out", "timed out", "NCCL"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        env = detect_launch_env()
        # --print-config outside a launcher (one process, no WORLD_SIZE) checks the config for the smallest
        # world it fits: one data-parallel rank of parallel.tensor processes
        world = env.world_size
        if args.print_config and env.launcher == "single" and world == 1:
            world = max(1, cfg.parallel.tensor)
        validate_config(cfg, world)
        check_inputs(cfg, devices=not args.print_config)  # files always; devices where the run will happen
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        prepare_output_dirs(cfg)
    except LaunchError as e:  # the rank itself may be wrong: every process says it
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")).strip() in ("0", ""):  # say it once
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # the launcher stops every process when the first one exits: leave rank 0 the time to say it
            time.sleep(5.0)
        return 2
    if env.world_size > 1 and env.rank == 0:
        print(f"waiting for {env.world_size} processes ({env.launcher} launch) at {env.master_addr}:{env.master_port}",
              flush=True)
    try:
        pctx = init_parallel(cfg.parallel.tensor, cfg.train.device, cfg.parallel.backend,
                             cfg.parallel.timeout_minutes, env)
    except LaunchError as e:  # a rendezvous that did not complete: every process says what it saw
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg, pctx)
    except ConfigError as e:
        print(f"error (rank {pctx.rank}): {e}", file=sys.stderr)
        return 2
    except NonFiniteGradientError as e:
        print(f"error (rank {pctx.rank}): {e}", file=sys.stderr)
        return 3
    except StopRequested as e:
        if pctx.is_main:
            print(str(e), flush=True)
        return 4
    except CheckpointSaveError as e:
        if pctx.is_main:
            print(f"error: {e}", file=sys.stderr)
        return 6
    except (dist.DistError, RuntimeError) as e:
        if not isinstance(e, dist.DistError) and not _is_collective_failure(e):
            raise
        print(f"error (rank {pctx.rank}): a collective failed: another rank died or did not answer within "
              f"parallel.timeout_minutes={cfg.parallel.timeout_minutes} ({type(e).__name__}: {e})", file=sys.stderr)
        return 5
    finally:
        destroy_parallel()
    return 0
