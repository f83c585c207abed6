"""The trainer's checkpoint glue: resume at start-up and save during training (see
:mod:`megatron_geo.checkpoint` for the format and the atomic publication)."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint.manager import (abandon_later, check_compatible, checkpoint_root, read_meta, resolve_load,
                                  save_checkpoint)
from ..checkpoint.state import StateLayout, build_save_state, load_state, optimizer_state_ready
from ..config import Config, ConfigError, config_to_dict
from ..parallel import ParallelContext
from ..parallel import collectives as C


class Checkpointer:
    """Save and resume one run's complete training state (collective calls: every rank makes them)."""

    def __init__(self, cfg: Config, pctx: ParallelContext, model, optimizer, reducer, geo, log):
        self.cfg, self.pctx, self.reducer, self.geo, self.log = cfg, pctx, reducer, geo, log
        self.layout = StateLayout(model, optimizer, pctx, cfg.model.vocab_size, cfg.optimizer.name)
        self.root = checkpoint_root(cfg)
        self.last_saved_step = -1
        self.last_path: str | None = None

    def resume(self) -> tuple[int, int, int]:
        """Load the checkpoint ``checkpoint.load`` selects, if any.

        Returns:
            ``(step, consumed_samples, skipped_in_a_row)`` to continue from (zeros for a fresh start).

        Raises:
            ConfigError: the checkpoint is damaged or from another model/optimizer (names the mismatch).
        """
        path = resolve_load(self.cfg, self.log)
        if path is None:
            return 0, 0, 0
        meta = read_meta(path)
        meta["path"] = str(path)
        same, notes = check_compatible(meta, self.cfg, self.pctx.dp_size, self.pctx.tp_size)
        for n in notes:
            self.log(f"checkpoint: {n}")
        try:
            load_state(str(path), self.layout, self.reducer, self.geo, same, meta.get("geo"), self.log,
                       same_tp=meta["tp_size"] == self.pctx.tp_size)
        except ValueError as e:  # includes UnsafeCheckpointError
            raise ConfigError(str(e)) from None
        except (CheckpointException, OSError, RuntimeError) as e:  # DCP raises on every rank alike
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"checkpoint {path} could not be read ({type(e).__name__}: {first[:300]}); it is damaged "
                              f"or incomplete: load an older one (checkpoint.load=PATH of another step_* folder) or "
                              f"start fresh (checkpoint.load=none)") from None
        self.last_saved_step = meta["step"]
        if self.pctx.is_main:  # resuming from step N starts a new timeline: later checkpoints are moved aside
            for src, dest in abandon_later(self.root, meta["step"]):
                self.log(f"checkpoint: {src.name} belongs to an abandoned timeline (resumed at step {meta['step']}); "
                         + (f"moved to {dest}" if dest else "removed (an interrupted save)"))
        C.barrier(self.pctx.world_group)
        self.log(f"resumed from {path} at step {meta['step']} ({meta['consumed_samples']:,} samples consumed)")
        return meta["step"], meta["consumed_samples"], meta.get("skipped_in_a_row", 0)

    def save(self, step: int, consumed: int, skipped_in_a_row: int = 0) -> Path | None:
        """Checkpoint the state after ``step`` optimizer steps (once per step)."""
        if step == self.last_saved_step:
            return None
        self.layout.optimizer.wait_param_gather()
        with_state = optimizer_state_ready(self.layout.optimizer, self.pctx.world_group)
        state = build_save_state(self.layout, self.reducer, self.geo, with_state)
        geo = self.geo
        meta = {"consumed_samples": consumed, "dp_size": self.pctx.dp_size, "tp_size": self.pctx.tp_size,
                "skipped_in_a_row": skipped_in_a_row, "config": config_to_dict(self.cfg),
                "geo": None if geo is None else {"last_refresh": geo.last_refresh, "selected": sorted(geo.selected),
                                                 "profiled": geo.profiled}}
        path = save_checkpoint(self.root, step, state, meta, self.cfg.checkpoint.keep_latest,
                               self.pctx.world_group, self.pctx.is_main)
        self.last_saved_step = step
        self.last_path = str(path)
        self.log(f"step {step}: checkpoint saved to {path}")
        return path
