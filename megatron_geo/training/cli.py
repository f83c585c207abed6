"""The command line of ``pretrain_llama.py``: arguments, config resolution and checks, the process group, the
training run, and the exit codes:

- 0: done (or ``--print-config``, or ``train.exit_interval`` reached);
- 2: a config, input, launch or checkpoint-load error, or a run folder in use by another live launch
  (:mod:`.run_lock`), said in one line (``error: ...``);
- 3: a non-finite gradient norm stopped the run (``train.nonfinite=stop`` or ``train.max_skipped_steps``);
- 4: a stop signal (SIGTERM / SIGUSR1 / SIGINT) arrived and a checkpoint was saved;
- 5: a collective failed (another rank died or did not answer within ``parallel.timeout_minutes``);
- 6: a checkpoint could not be saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from ..checkpoint.manager import CheckpointSaveError
from ..checkpoint.start import resolve_start
from ..config import Config, ConfigError, dump_config, load_config
from ..parallel import LaunchError, destroy_parallel, detect_launch_env, init_parallel
from .checkpointing import StopRequested
from .launch_checks import check_data_inputs
from .run_lock import RunLock, acquire_run_lock
from .trainer import NonFiniteGradientError, train
from .validate import check_inputs, validate_config
from .wandb_login import check_wandb_login


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """``--config FILE`` (repeatable), ``--print-config`` and ``section.key=value`` overrides, in any order."""
    p = argparse.ArgumentParser(
        description="Pretrain a Llama with TP x DP and pluggable gradient reduction.",
        epilog="Overrides: section.key=value, e.g. train.steps=20 comm.dtype=bf16",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML config; repeat to merge several in order (e.g. a model file, then a comm preset)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="dotted section.key=value overrides applied last")
    return p.parse_intermixed_args(argv)  # --config may come after overrides too


def prepare_output_dirs(cfg: Config) -> None:
    """Create ``train.run_dir`` and the checkpoint folder before any work, so that an unwritable place is
    a start-up error (exit 2) and not a failure at the first save.

    Raises:
        ConfigError: a folder cannot be created or written (names the key and the path).
    """
    from ..checkpoint.manager import checkpoint_root

    for key, path in (
        ("train.run_dir", Path(cfg.train.run_dir)),
        ("checkpoint.dir" if cfg.checkpoint.dir else "train.run_dir (its checkpoints/)", checkpoint_root(cfg)),
    ):
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"{key}: cannot create or write {str(path)!r} ({e.strerror or e}); choose a writable folder"
            ) from None


class RunFolderBusy(ConfigError):
    """Another live launch holds the run folder's lock (:mod:`.run_lock`); the message is rank 0's."""


def _lock_run_folder(cfg: Config, pctx) -> RunLock | None:
    """Rank 0 locks the run folder (:func:`.run_lock.acquire_run_lock`) and every rank learns the outcome
    (collective over the world group). Returns rank 0's lock (None on the other ranks).

    Raises:
        RunFolderBusy: on every rank, when rank 0 could not take the lock (rank 0's message).
    """
    from ..checkpoint.agreement import CheckpointRankError, agree

    lock, err = None, None
    if pctx.is_main:
        try:
            lock = acquire_run_lock(cfg)
        except ConfigError as e:
            err = e
    try:
        agree(err, pctx.world_group, pctx.device, "locking the run folder")
    except CheckpointRankError as e:
        raise RunFolderBusy(str(err) if err is not None else e.message) from None
    if lock is not None:
        for note in lock.notes:
            print(note, flush=True)
    return lock


def _is_collective_failure(e: BaseException) -> bool:
    """gloo reports a dead peer or a timeout as a plain RuntimeError from its transport."""
    msg = str(e)
    return any(k in msg for k in ("gloo", "Connection reset", "Connection closed", "Timed out", "timed out", "NCCL"))


def main(argv: list[str] | None = None) -> int:
    """Run ``pretrain_llama.py`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code of the module
    docstring (an error that is none of those propagates as a traceback)."""
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
        check_data_inputs(cfg, write=not args.print_config)  # tokenizer, vocabulary, corpus cache
        if args.print_config:
            if env.rank == 0:  # under a launcher every process checks the config; one prints it
                print(dump_config(cfg), end="")
            return 0
        # every rank (the check reads files only): a rank that went on would create the run's folders while rank 0
        # stops; the wandb run itself is made on rank 0
        check_wandb_login(cfg)
        resolve_start(cfg)  # where the launch starts, or why it cannot (read-only; again after the lock)
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
        print(
            f"waiting for {env.world_size} processes ({env.launcher} launch) at {env.master_addr}:{env.master_port}",
            flush=True,
        )
    try:
        pctx = init_parallel(
            cfg.parallel.tensor, cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_minutes, env
        )
    except LaunchError as e:  # a rendezvous that did not complete: every process says what it saw
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        lock = _lock_run_folder(cfg, pctx)
    except RunFolderBusy as e:
        if pctx.is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)
        destroy_parallel()
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
        print(
            f"error (rank {pctx.rank}): a collective failed: another rank died or did not answer within "
            f"parallel.timeout_minutes={cfg.parallel.timeout_minutes} ({type(e).__name__}: {e})",
            file=sys.stderr,
        )
        return 5
    finally:
        if lock is not None:
            lock.release()
        destroy_parallel()
    return 0
