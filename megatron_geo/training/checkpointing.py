"""The trainer's checkpoint glue: resume at start-up and save during training (see
:mod:`megatron_geo.checkpoint` for the format and the atomic publication)."""

from __future__ import annotations

import zlib
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint.agreement import CheckpointRankError, agree, all_gather_ints
from ..checkpoint.manager import (abandon_later, check_compatible, checkpoint_root, read_meta, resolve_load,
                                  save_checkpoint, state_failure)
from ..checkpoint.state import StateLayout, build_save_state, load_state, optimizer_state_ready
from ..config import Config, ConfigError, config_to_dict
from ..parallel import ParallelContext


class Checkpointer:
    """Save and resume one run's complete training state (collective calls: every rank makes them)."""

    def __init__(self, cfg: Config, pctx: ParallelContext, model, optimizer, reducer, geo, log):
        self.cfg, self.pctx, self.reducer, self.geo, self.log = cfg, pctx, reducer, geo, log
        self.layout = StateLayout(model, optimizer, pctx, cfg.model.vocab_size, cfg.optimizer.name)
        self.root = checkpoint_root(cfg)
        self.last_saved_step = -1
        self.last_path: str | None = None

    def resume(self) -> tuple[int, int, int]:
        """Load the checkpoint ``checkpoint.load`` selects, if any (collective over the world group).

        Returns:
            ``(step, consumed_samples, skipped_in_a_row)`` to continue from (zeros for a fresh start).

        Raises:
            ConfigError: on every rank, when the checkpoint is damaged, unreadable on some rank, from another
                model/optimizer (names the mismatch), not the same one on every rank, or a rank failed
                while loading it (names the rank and its error).
        """
        pctx = self.pctx
        world, dev = pctx.world_group, pctx.device
        path = meta = same = None
        err = None
        try:
            path = resolve_load(self.cfg, self.log)
            if path is not None:
                meta = read_meta(path)
                meta["path"] = str(path)
                same, notes = check_compatible(meta, self.cfg, pctx.dp_size, pctx.tp_size)
                for n in notes:
                    self.log(f"checkpoint: {n}")
        except Exception as e:  # noqa: BLE001 - the other ranks would wait in the load's collectives
            err = e
        try:
            agree(err, world, dev, "finding the checkpoint to resume from")
        except CheckpointRankError as e:
            if isinstance(err, ConfigError):
                raise err from None  # this rank's own message, which names the value and the fix
            raise ConfigError(f"resuming failed on rank {e.rank}: {e.message}") from None
        # every rank must load the same checkpoint (a checkpoint.dir on node-local disks is not the same folder)
        names = all_gather_ints([-1 if path is None else zlib.crc32(path.name.encode()), meta["step"] if meta else -1],
                                world, dev)
        if len({tuple(v) for v in names}) > 1:
            others = [r for r, v in enumerate(names) if v != names[pctx.rank]]
            raise ConfigError(f"the ranks resolved different checkpoints from checkpoint.load="
                              f"{self.cfg.checkpoint.load}: rank {pctx.rank} found "
                              f"{path if path is not None else 'none'}, rank(s) {', '.join(map(str, others[:8]))} "
                              f"another; checkpoint.dir must be one folder that every node sees (not a node-local "
                              f"disk), or point checkpoint.load at the same step_* folder on each") from None
        if path is None:
            return 0, 0, 0
        try:
            load_state(str(path), self.layout, self.reducer, self.geo, same, meta.get("geo"), self.log,
                       same_tp=meta["tp_size"] == pctx.tp_size)
        except CheckpointRankError as e:  # raised on every rank alike
            if e.kind == "value":  # includes UnsafeCheckpointError: the message names the mismatch and the fix
                raise ConfigError(e.message if e.rank == pctx.rank else f"rank {e.rank}: {e.message}") from None
            if e.kind == "io":
                raise ConfigError(f"checkpoint {path} could not be read on rank {e.rank} ({e.error_type}: "
                                  f"{e.message.splitlines()[0][:300]}); it is damaged or incomplete, or not visible "
                                  f"from every node: load an older one (checkpoint.load=PATH of another step_* "
                                  f"folder) or start fresh (checkpoint.load=none)") from None
            raise ConfigError(f"checkpoint {path} could not be loaded: {e.phase} failed on rank {e.rank} with "
                              f"{e.error_type}: {e.message.splitlines()[0][:300]} (the checkpoint itself passed its "
                              f"checks); start fresh (checkpoint.load=none) or report this error") from None
        except (CheckpointException, OSError, RuntimeError) as e:  # DCP raises on every rank alike
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"checkpoint {path} could not be read ({type(e).__name__}: {first[:300]}); it is damaged "
                              f"or incomplete: load an older one (checkpoint.load=PATH of another step_* folder) or "
                              f"start fresh (checkpoint.load=none)") from None
        self.last_saved_step = meta["step"]
        err, moved = None, []
        if pctx.is_main:  # resuming from step N starts a new timeline: later checkpoints are moved aside
            try:
                moved = abandon_later(self.root, meta["step"])
            except Exception as e:  # noqa: BLE001 - the other ranks wait below
                err = e
            for src, dest in moved:
                self.log(f"checkpoint: {src.name} belongs to an abandoned timeline (resumed at step {meta['step']}); "
                         + (f"moved to {dest}" if dest else "removed (an interrupted save)"))
        try:
            agree(err, world, dev, "moving the abandoned timeline aside")  # also the barrier
        except CheckpointRankError as e:
            raise ConfigError(f"{e}; fix the permissions of {self.root} (or move its later step_* folders away) and "
                              f"relaunch") from None
        self.log(f"resumed from {path} at step {meta['step']} ({meta['consumed_samples']:,} samples consumed)")
        return meta["step"], meta["consumed_samples"], meta.get("skipped_in_a_row", 0)

    def save(self, step: int, consumed: int, skipped_in_a_row: int = 0) -> Path | None:
        """Checkpoint the state after ``step`` optimizer steps (once per step)."""
        if step == self.last_saved_step:
            return None
        self.layout.optimizer.wait_param_gather()
        with_state = optimizer_state_ready(self.layout.optimizer, self.pctx.world_group)
        try:
            state = build_save_state(self.layout, self.reducer, self.geo, with_state)
        except CheckpointRankError as e:  # raised on every rank alike, before anything is written
            raise state_failure(self.root, step, e) from None
        geo = self.geo
        meta = {"consumed_samples": consumed, "dp_size": self.pctx.dp_size, "tp_size": self.pctx.tp_size,
                "skipped_in_a_row": skipped_in_a_row, "config": config_to_dict(self.cfg),
                "geo": None if geo is None else {"last_refresh": geo.last_refresh, "selected": sorted(geo.selected),
                                                 "profiled": geo.profiled}}
        path = save_checkpoint(self.root, step, state, meta, self.cfg.checkpoint.keep_latest,
                               self.pctx.world_group, self.pctx.is_main, device=self.pctx.device)
        self.last_saved_step = step
        self.last_path = str(path)
        self.log(f"step {step}: checkpoint saved to {path}")
        return path
