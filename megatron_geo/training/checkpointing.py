"""The trainer's checkpoint glue: resume at start-up and save during training (see
:mod:`megatron_geo.checkpoint` for the format and the atomic publication)."""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint.agreement import CheckpointRankError, agree, all_gather_ints
from ..checkpoint.manager import (
    abandon_later,
    check_compatible,
    checkpoint_root,
    read_meta,
    save_checkpoint,
    state_failure,
)
from ..checkpoint.resume_changes import check_data_files, check_resume_changes
from ..checkpoint.shared_dir import check_checkpoint_dir
from ..checkpoint.start import StartPoint, resolve_start, run_folder_identity, timeline_of
from ..checkpoint.state import StateLayout, build_save_state, load_state, optimizer_state_ready
from ..config import Config, ConfigError, config_to_dict
from ..parallel import ParallelContext


def launch_neutral(cfg: Config) -> Config:
    """``cfg`` as the run's record (``config.yaml``, checkpoint metadata): without the one-launch permission
    ``checkpoint.allow_changes``, so a reloaded config never carries it into later resumes."""
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, allow_changes=""))


def _record_config(cfg: Config) -> dict:
    """The config a checkpoint records (:func:`launch_neutral`)."""
    return config_to_dict(launch_neutral(cfg))


def resume_hint(cfg: Config) -> str:
    """How to continue this run from the checkpoint just saved."""
    if cfg.checkpoint.load == "none":
        return (
            "relaunch with checkpoint.load=auto to resume (checkpoint.load=none starts this folder over at every "
            "launch)"
        )
    return "relaunch with the same train.run_dir to resume"


class StopRequested(Exception):
    """A stop signal arrived; a checkpoint was saved (exit code 4)."""


@dataclasses.dataclass(frozen=True)
class DataFiles:
    """The run's data files as every checkpoint records them (``meta.json`` ``data_files`` / ``valid_files``) and a
    resume compares them (:func:`~megatron_geo.checkpoint.resume_changes.check_data_files`): ``train`` the training
    files, ``valid`` the separate validation files (none when validation is split off the training files), each an
    identity dict of :func:`megatron_geo.data.identity.dataset_identity`."""

    train: Sequence[dict] = ()
    valid: Sequence[dict] = ()


class Checkpointer:
    """Save and resume one run's complete training state (collective calls: every rank makes them).

    ``model``, ``optimizer``, ``reducer`` and ``geo`` (the GeoFP8 state or None) are the state saved and loaded;
    ``log`` takes one line; ``data_files`` (:class:`DataFiles`; None: none) are recorded and compared on resume.
    """

    def __init__(
        self,
        cfg: Config,
        pctx: ParallelContext,
        model,
        optimizer,
        reducer,
        geo,
        log,
        data_files: DataFiles | None = None,
    ):
        self.cfg, self.pctx, self.reducer, self.geo, self.log = cfg, pctx, reducer, geo, log
        self.layout = StateLayout(model, optimizer, pctx, cfg.model.vocab_size, cfg.optimizer.name)
        self.root = checkpoint_root(cfg)
        check_checkpoint_dir(cfg, pctx)  # one folder that every rank sees, before any training (collective)
        self.last_saved_step = -1
        self.last_path: str | None = None
        self.start: StartPoint | None = None  # set by resume(): what this launch loaded and why
        self.timeline: dict = {"start": "fresh"}  # recorded in every checkpoint this launch saves
        # the training files (data/identity.py): recorded in every checkpoint, compared on resume
        files = data_files or DataFiles()
        self.data_files: list[dict] = list(files.train)
        self.valid_files: list[dict] = list(files.valid)
        self.meta: dict | None = None  # set by resume(): the loaded checkpoint's meta.json (None: a fresh start)
        # the training data's index rule and blend position (training/data_setup.py): recorded as ``data``
        self.data_record: dict | None = None

    def resume(self) -> tuple[int, int, int]:
        """Load the checkpoint :func:`megatron_geo.checkpoint.start.resolve_start` selects, if any (collective
        over the world group); ``self.start`` says what was loaded and why.

        Returns:
            ``(step, consumed_samples, skipped_in_a_row)`` to continue from (zeros for a fresh start).

        Raises:
            ConfigError: on every rank, when the checkpoint is damaged, unreadable on some rank, from another
                model/optimizer (names the mismatch), not the same one on every rank, a resume would change
                the run's trajectory (:mod:`megatron_geo.checkpoint.resume_changes`), or a rank failed while
                loading it (names the rank and its error).
        """
        pctx = self.pctx
        world, dev = pctx.world_group, pctx.device
        path = meta = same = None
        err = None
        try:
            start = resolve_start(self.cfg, self.log)
            path = start.path
            if path is not None:
                meta = read_meta(path)
                meta["path"] = str(path)
                same, notes = check_compatible(meta, self.cfg, pctx.dp_size, pctx.tp_size)
                notes += check_resume_changes(meta["config"], self.cfg, meta["step"], start.kind)
                notes += check_data_files(
                    meta.get("data_files"), self.data_files, self.cfg, start.kind, saved_cfg=meta["config"]
                )
                notes += check_data_files(
                    meta.get("valid_files"), self.valid_files, self.cfg, start.kind, meta["config"], "validation"
                )
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
        names = all_gather_ints(
            [-1 if path is None else zlib.crc32(path.name.encode()), meta["step"] if meta else -1], world, dev
        )
        if len({tuple(v) for v in names}) > 1:
            others = [r for r, v in enumerate(names) if v != names[pctx.rank]]
            raise ConfigError(
                f"the ranks resolved different checkpoints from checkpoint.load="
                f"{self.cfg.checkpoint.load}: rank {pctx.rank} found "
                f"{path if path is not None else 'none'}, rank(s) {', '.join(map(str, others[:8]))} "
                f"another; checkpoint.dir must be one folder that every node sees (not a node-local "
                f"disk), or point checkpoint.load at the same step_* folder on each"
            ) from None
        self.start = start
        self.timeline = timeline_of(meta, start.kind, path)
        if path is None:
            self._abandon(-1)  # a fresh start in a folder with checkpoints begins a new timeline
            self.log(f"checkpoint: {start.reason}")
            return 0, 0, 0
        assert meta is not None and same is not None  # read with the path above (agree raised otherwise)
        try:
            load_state(
                str(path),
                self.layout,
                self.reducer,
                self.geo,
                same,
                meta.get("geo"),
                self.log,
                same_tp=meta["tp_size"] == pctx.tp_size,
            )
        except CheckpointRankError as e:  # raised on every rank alike
            if e.kind == "value":  # includes UnsafeCheckpointError: the message names the mismatch and the fix
                raise ConfigError(e.message if e.rank == pctx.rank else f"rank {e.rank}: {e.message}") from None
            if e.kind == "io":
                raise ConfigError(
                    f"checkpoint {path} could not be read on rank {e.rank} ({e.error_type}: "
                    f"{e.message.splitlines()[0][:300]}); it is damaged or incomplete, or not visible "
                    f"from every node: load an older one (checkpoint.load=PATH of another step_* "
                    f"folder) or start fresh (checkpoint.load=none)"
                ) from None
            raise ConfigError(
                f"checkpoint {path} could not be loaded: {e.phase} failed on rank {e.rank} with "
                f"{e.error_type}: {e.message.splitlines()[0][:300]} (the checkpoint itself passed its "
                f"checks); start fresh (checkpoint.load=none) or report this error"
            ) from None
        except (CheckpointException, OSError, RuntimeError) as e:  # DCP raises on every rank alike
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"checkpoint {path} could not be read ({type(e).__name__}: {first[:300]}); it is damaged "
                f"or incomplete: load an older one (checkpoint.load=PATH of another step_* folder) or "
                f"start fresh (checkpoint.load=none)"
            ) from None
        self.last_saved_step = meta["step"]
        self.meta = meta
        self._abandon(meta["step"])
        self.log(f"checkpoint: {start.reason}, at step {meta['step']} ({meta['consumed_samples']:,} samples consumed)")
        return meta["step"], meta["consumed_samples"], meta.get("skipped_in_a_row", 0)

    def _abandon(self, step: int) -> None:
        """Starting at ``step`` begins a new timeline: rank 0 moves the later checkpoints of the run's folder
        aside (collective; ``step=-1``: all of them)."""
        err, moved = None, []
        if self.pctx.is_main:
            try:
                moved = abandon_later(self.root, step)
            except Exception as e:  # noqa: BLE001 - the other ranks wait below
                err = e
            at = "a fresh start" if step < 0 else f"resumed at step {step}"
            for src, dest in moved:
                self.log(
                    f"checkpoint: {src.name} belongs to an abandoned timeline ({at}); "
                    + (f"moved to {dest}" if dest else "removed (an interrupted save)")
                )
        try:
            agree(err, self.pctx.world_group, self.pctx.device, "moving the abandoned timeline aside")  # a barrier
        except CheckpointRankError as e:
            raise ConfigError(
                f"{e}; fix the permissions of {self.root} (or move its later step_* folders away) and relaunch"
            ) from None

    def maybe_save(
        self,
        step: int,
        consumed: int,
        skipped_in_a_row: int,
        stop: int | None = None,
        fatal: Exception | None = None,
        timer=None,
    ) -> bool:
        """After optimizer step ``step`` (1-based): save when this step is a save point, and say whether the loop
        ends here (collective: every rank calls it after every step with the same arguments).

        Args:
            step, consumed, skipped_in_a_row: what the checkpoint records (steps done, samples consumed,
                non-finite steps skipped in a row).
            stop: the signal every rank agreed to stop on (``StopRequest.signal``), or None.
            fatal: an error that ends the run after this step (a non-finite gradient with
                ``train.nonfinite=stop`` or too many skipped steps), or None.
            timer: a :class:`~.eta.RunTimer`: the periodic saves are timed in it as ``"save"``.

        In this order: every ``checkpoint.interval`` steps a timed save; ``fatal``: save, raise it;
        ``train.exit_interval``: save, say so, end the loop; ``stop``: save, raise :class:`StopRequested`; the
        last step (``train.steps``) with ``checkpoint.save_at_end``: save. A step is saved once whatever the
        reasons.

        Returns:
            True when the loop ends after this step (``train.exit_interval``).

        Raises:
            ``fatal``; StopRequested; CheckpointSaveError: the save failed (on every rank alike).
        """
        t, every = self.cfg.train, self.cfg.checkpoint.interval
        if every and step % every == 0:
            with timer.timing("save") if timer is not None else contextlib.nullcontext():
                self.save(step, consumed, skipped_in_a_row)
        exiting = bool(t.exit_interval) and step % t.exit_interval == 0 and step < t.steps
        if fatal is not None or exiting or stop is not None or (step == t.steps and self.cfg.checkpoint.save_at_end):
            self.save(step, consumed, skipped_in_a_row)
        if fatal is not None:
            raise fatal
        if exiting:
            self.log(f"step {step}: exiting (train.exit_interval={t.exit_interval}); {resume_hint(self.cfg)}")
        elif stop is not None:
            raise StopRequested(
                f"stopped by signal {stop} after step {step}; checkpoint saved to {self.root}; {resume_hint(self.cfg)}"
            )
        return exiting

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
        meta = {
            "consumed_samples": consumed,
            "dp_size": self.pctx.dp_size,
            "tp_size": self.pctx.tp_size,
            "skipped_in_a_row": skipped_in_a_row,
            "timeline": self.timeline,
            "run_dir": run_folder_identity(self.cfg.train.run_dir),  # whose checkpoint it is (checkpoint/start.py)
            "config": _record_config(self.cfg),
            "data_files": self.data_files,
            "valid_files": self.valid_files,
            "data": self.data_record,
            "geo": None
            if geo is None
            else {"last_refresh": geo.last_refresh, "selected": sorted(geo.selected), "profiled": geo.profiled},
        }
        path = save_checkpoint(
            self.root,
            step,
            state,
            meta,
            self.cfg.checkpoint.keep_latest,
            self.pctx.world_group,
            self.pctx.is_main,
            device=self.pctx.device,
        )
        self.last_saved_step = step
        self.last_path = str(path)
        self.log(f"step {step}: checkpoint saved to {path}")
        return path
