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

Two more rules hold whatever ``checkpoint.load`` says:

- The checkpoints of ``checkpoint.dir`` belong to the run folder that saved them (``meta.json`` ``run_dir``).
  When ``checkpoint.dir`` is outside this run's folder (a shared ``checkpoint.dir`` in a sweep's YAML) and holds
  a checkpoint saved by another run folder, the launch is refused: it would continue (or, with ``none``, move
  aside) another run's timeline. A ``checkpoint.dir`` inside the run folder (the default ``<run_dir>/checkpoints``)
  is always the folder's own, so a moved run folder keeps resuming.
- An explicit path that is not a complete checkpoint is an error, also when the run folder has checkpoints of its
  own (a typo must not silently skip the roll-back it asked for), except when the run's own timeline started
  from that path (a requeue after the source was pruned or moved).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError
from .manager import (
    META,
    checkpoint_root,
    complete_checkpoints,
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
    """Whether the timeline of the checkpoint ``own`` began at ``target`` (a step folder, or the checkpoints
    folder holding it); ``target`` need not exist any more."""
    try:
        tl = read_meta(own).get("timeline")
    except ConfigError:
        return False
    if not isinstance(tl, dict) or not isinstance(tl.get("from"), str):
        return False
    want = str(target.resolve())
    return tl["from"] == want or str(Path(tl["from"]).parent) == want


def run_folder_identity(run_dir: str | Path) -> dict:
    """What a checkpoint records of the run folder that saved it (``meta.json`` ``run_dir``): the resolved path
    and the folder's inode (so a folder moved within its file system, or mounted elsewhere, is still known)."""
    path = Path(run_dir)
    try:
        inode = path.stat().st_ino
    except OSError:
        inode = None
    return {"path": str(path.resolve()), "inode": inode}


def _saved_by(path: Path) -> dict | None:
    """The run folder a checkpoint was saved by (:func:`run_folder_identity`; for checkpoints of earlier versions
    the resolved ``train.run_dir`` of its config, without an inode), or None when ``meta.json`` does not say."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None  # a damaged folder: the load reports it
    if not isinstance(meta, dict):
        return None
    rec = meta.get("run_dir")
    if isinstance(rec, dict) and isinstance(rec.get("path"), str):
        return {"path": rec["path"], "inode": rec.get("inode")}
    train = meta.get("config", {}).get("train") if isinstance(meta.get("config"), dict) else None
    if isinstance(train, dict) and isinstance(train.get("run_dir"), str) and train["run_dir"]:
        return {"path": str(Path(train["run_dir"]).resolve()), "inode": None}
    return None


def _is_inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def foreign_checkpoint(cfg: Config) -> tuple[Path, str] | None:
    """A checkpoint of ``checkpoint.dir`` saved by another run folder than ``train.run_dir``:
    ``(its folder, that run folder)``, the newest such one; None when there is none, or when ``checkpoint.dir`` is
    inside the run folder (the default ``<run_dir>/checkpoints``: a moved run folder's checkpoints stay its own)."""
    root, run_dir = checkpoint_root(cfg), Path(cfg.train.run_dir)
    if _is_inside(root, run_dir):
        return None
    here = run_folder_identity(run_dir)
    for ckpt in reversed(complete_checkpoints(root)):
        by = _saved_by(ckpt)
        if by is None or by["path"] == here["path"]:
            continue
        if by.get("inode") is not None and by["inode"] == here["inode"]:
            continue  # the same folder, moved or mounted elsewhere
        return ckpt, by["path"]
    return None


def _names_near(mode: str, root: Path) -> str:
    """The complete checkpoints next to a missing explicit path and in the run's own folder, for its error."""
    parts = []
    for folder in dict.fromkeys((Path(mode).parent, root)):
        found = [p.name for p in complete_checkpoints(folder)]
        if found:
            more = f" and {len(found) - 8} more" if len(found) > 8 else ""
            parts.append(f"{folder} holds {', '.join(found[-8:])}{more}")
    return "; ".join(parts) if parts else f"{root} holds no complete checkpoint"


def resolve_start(cfg: Config, log=None) -> StartPoint:
    """Apply the rules of this module to ``cfg`` (reads the file system only; the same on every rank when
    ``checkpoint.dir`` is shared).

    Raises:
        ConfigError: ``checkpoint.dir`` (outside the run folder) holds a checkpoint saved by another run folder
            (naming both folders and the fix); ``latest`` with nothing to resume; a damaged ``latest`` pointer with
            no complete checkpoint left (for ``auto`` and explicit paths alike: a run is never restarted over its
            own damaged checkpoint); an explicit path that is not a complete checkpoint (naming the checkpoints
            that exist), unless the run's own timeline started from it.
    """
    mode, root = cfg.checkpoint.load, checkpoint_root(cfg)
    foreign = foreign_checkpoint(cfg)
    if foreign is not None:
        ckpt, other = foreign
        raise ConfigError(
            f"checkpoint.dir={root} holds {ckpt.name}, saved by the run folder {other}, not by this run's "
            f"train.run_dir={Path(cfg.train.run_dir).resolve()}; a run never continues (or moves aside) another "
            f"run's checkpoints: give this run its own checkpoint.dir (empty: <train.run_dir>/checkpoints), and "
            f"to start it from that checkpoint use checkpoint.load={ckpt}"
        )
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
        if own is None or not _started_from(own, Path(mode)):
            raise
        target = None  # the run's own timeline began there: a requeue resumes it
    if target is None and (own is None or not _started_from(own, Path(mode))):
        # a typo or a pruned folder: never resume something else than what was asked for
        raise ConfigError(
            f"checkpoint.load={mode!r} does not exist; {_names_near(mode, root)}: fix the path (a step_* folder "
            f"or a checkpoints folder), or use checkpoint.load=auto to "
            + ("resume this run's newest checkpoint" if own is not None else "start fresh")
        )
    if own is None:
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
        if _started_from(own, target if target is not None else Path(mode))
        else "checkpoint.load only initialises a run folder that has no checkpoint of its own; use a new "
        "train.run_dir to start another run from it"
    )
    return StartPoint(
        own, "resume", f"resuming this run from its own checkpoint {own}; checkpoint.load={mode} is not loaded ({why})"
    )
