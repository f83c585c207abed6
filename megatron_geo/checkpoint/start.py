"""Where a launch starts: the run's own checkpoint, an explicit checkpoint that initialises it, or nothing.

A run is identified by its checkpoint folder (``checkpoint.dir``, default ``<train.run_dir>/checkpoints``).
Every relaunch of the same command (a Slurm requeue, a torchrun restart, an ``exit_interval`` stop) must
continue the run's own timeline, so the rules are (like Megatron-LM's ``--load`` before
``--pretrained-checkpoint``):

==========================  ==============================  ===========================================
``checkpoint.load``          the run folder holds             the launch
==========================  ==============================  ===========================================
``auto``                     a complete checkpoint            resumes it
``auto``                     none                             starts fresh
``latest``                   a complete checkpoint / none     resumes it / is an error
``none``                     anything                         starts fresh; earlier checkpoints of the
                                                              folder are moved to ``abandoned/``
PATH (elsewhere)             none                             initialises from PATH (its full state)
PATH (elsewhere)             a complete checkpoint            resumes the run's own checkpoint; PATH is
                                                              not used (the start-up line says so)
PATH (inside the folder)     later checkpoints not made        rolls back to PATH: the later ones are moved
                             after a start from PATH           to ``abandoned/``
PATH (inside the folder)     a checkpoint made after a        resumes that checkpoint (the roll-back
                             start from PATH                  already happened)
==========================  ==============================  ===========================================

Every checkpoint records the start of its timeline (``meta.json`` ``timeline``: how it began and from
which folder), inherited on resume, so the last rule can tell a requeue from a new roll-back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError
from .manager import (
    checkpoint_root,
    explicit_checkpoint,
    latest_checkpoint,
    latest_pointer_problem,
    read_meta,
    resolve_load,
)

KINDS = ("fresh", "resume", "init", "rollback")


@dataclass(frozen=True)
class StartPoint:
    """What this launch loads.

    Attributes:
        path: the checkpoint folder to load (None: fresh start).
        kind: ``fresh``, ``resume`` (the run's own checkpoint: nothing that changes the run's trajectory may
            differ), ``init`` (another run's checkpoint or an imported one starts this run) or ``rollback`` (an
            earlier checkpoint of this run starts a new timeline).
        reason: one line for the start-up log saying which happened and from where.
    """

    path: Path | None
    kind: str
    reason: str


def timeline_of(meta: dict | None, kind: str, path: Path | None) -> dict:
    """The ``timeline`` record the checkpoints saved after this launch carry.

    A resume inherits the loaded checkpoint's record; ``init`` / ``rollback`` start a new one from ``path``
    (its resolved absolute path and step); a fresh start records ``{"start": "fresh"}``.
    """
    if kind == "resume" and meta is not None and isinstance(meta.get("timeline"), dict):
        return dict(meta["timeline"])
    if kind in ("init", "rollback") and path is not None and meta is not None:
        return {"start": kind, "from": str(path.resolve()), "from_step": meta["step"]}
    return {"start": "fresh" if kind == "fresh" else "unknown"}


def _explicit_target(mode: str) -> Path | None:
    """The complete checkpoint an explicit ``checkpoint.load`` path names (a step folder, or a checkpoints
    folder through its ``latest``), or None when it does not exist (any more)."""
    return explicit_checkpoint(mode) if Path(mode).exists() else None


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().parent == root.resolve()
    except OSError:
        return False


def _started_from(own: Path, target: Path) -> bool:
    """Whether the timeline of the checkpoint ``own`` began at ``target``."""
    try:
        tl = read_meta(own).get("timeline")
    except ConfigError:
        return False
    return isinstance(tl, dict) and tl.get("from") == str(target.resolve())


def resolve_start(cfg: Config, log=None) -> StartPoint:
    """Apply the rules of this module to ``cfg`` (reads the file system only; the same on every rank when
    ``checkpoint.dir`` is shared).

    Raises:
        ConfigError: ``latest`` with nothing to resume, a damaged ``latest`` pointer with no complete
            checkpoint left (for ``auto`` and explicit paths alike: a run is never restarted over its own
            damaged checkpoint), an explicit path that is not a complete checkpoint while the run folder has
            none of its own.
    """
    mode, root = cfg.checkpoint.load, checkpoint_root(cfg)
    if mode == "none":
        return StartPoint(None, "fresh", "starting fresh (checkpoint.load=none)")
    if mode in ("auto", "latest"):
        found = resolve_load(cfg, log)
        if found is None:
            return StartPoint(None, "fresh", f"starting fresh: {root} holds no checkpoint (checkpoint.load={mode})")
        return StartPoint(found, "resume", f"resuming this run from its own checkpoint {found}")
    own = latest_checkpoint(root)
    problem = latest_pointer_problem(root)
    if own is None and problem:
        raise ConfigError(
            f"{problem}, and {root} holds no other complete checkpoint; this run folder's own "
            f"checkpoint is damaged, so checkpoint.load={mode} would silently start its timeline over: "
            f"repair or remove {root}, or use another train.run_dir"
        )
    try:
        target = _explicit_target(mode)
    except ConfigError:
        if own is None:
            raise
        target = None  # the run's own checkpoint is resumed whatever the explicit path holds
    if own is None:
        if target is None:
            raise ConfigError(
                f"checkpoint.load={mode!r} does not exist and {root} holds no checkpoint of this run; "
                f"fix the path, or use checkpoint.load=auto to start fresh"
            )
        return StartPoint(
            target,
            "init",
            f"initialising this run from {target} (checkpoint.load); relaunches "
            f"resume the run's own checkpoints in {root}",
        )
    if (
        target is not None
        and _inside(target, root)
        and target.resolve() != own.resolve()
        and not _started_from(own, target)
    ):
        return StartPoint(
            target,
            "rollback",
            f"rolling back to {target} (checkpoint.load): a new timeline starts "
            f"at its step; the later checkpoints of {root} are moved aside",
        )
    why = (
        "its timeline started from it"
        if target is not None and _started_from(own, target)
        else "checkpoint.load only initialises a run folder that has no checkpoint of its own; use a new "
        "train.run_dir to start another run from it"
    )
    return StartPoint(
        own, "resume", f"resuming this run from its own checkpoint {own}; checkpoint.load={mode} is not loaded ({why})"
    )
