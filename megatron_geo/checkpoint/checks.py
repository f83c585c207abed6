"""Start-up checks of the ``checkpoint`` section (before any process group starts)."""

from __future__ import annotations

import dataclasses
import os

from ..config.errors import ConfigError
from ..config.schema import CheckpointConfig, Config
from .resume_changes import parse_allow_changes

# the words checkpoint.load takes besides a path (auto, latest, none), as the schema declares them
_LOAD_WORDS: tuple[str, ...] = next(f for f in dataclasses.fields(CheckpointConfig) if f.name == "load").metadata[
    "keywords"
]


def has_own_checkpoint(cfg: Config) -> bool:
    """Whether the run folder holds a complete checkpoint of its own (which a relaunch resumes whatever an
    explicit ``checkpoint.load`` names, so that path may be gone)."""
    from .manager import checkpoint_root, latest_checkpoint

    return latest_checkpoint(checkpoint_root(cfg)) is not None


def check_checkpoint_config(cfg: Config) -> None:
    """Check the ``checkpoint`` keys.

    Checked: ``interval`` and ``keep_latest >= 0``; ``load`` is ``auto``, ``latest``, ``none`` or an existing
    folder (or the run folder has a checkpoint of its own, which a relaunch resumes);
    ``allow_changes`` names keys a resume compares (:func:`.resume_changes.parse_allow_changes`).

    Raises:
        ConfigError: naming the key, the bad value and the fix.
    """
    ck = cfg.checkpoint
    for key in ("interval", "keep_latest"):
        if getattr(ck, key) < 0:
            raise ConfigError(
                f"checkpoint.{key}={getattr(ck, key)} must be >= 0 (checkpoint.interval=0: no periodic "
                f"saves; checkpoint.keep_latest=0: keep all)"
            )
    if not ck.load:
        raise ConfigError("checkpoint.load is empty; use auto, latest, none or a checkpoint folder")
    if ck.load not in _LOAD_WORDS and not os.path.isdir(ck.load) and not has_own_checkpoint(cfg):
        raise ConfigError(
            f"checkpoint.load={ck.load!r} is not a folder; use auto, latest, none or the path of a "
            f"checkpoint folder (e.g. {cfg.train.run_dir}/checkpoints/step_00000100)"
        )
    parse_allow_changes(ck.allow_changes)


def check_checkpoint_inputs(cfg: Config) -> None:
    """``checkpoint.load``, when a path, names an existing folder (or the run folder has a checkpoint of its own).

    Raises:
        ConfigError: naming the path and the valid values.
    """
    ck = cfg.checkpoint.load
    if ck not in (*_LOAD_WORDS, "") and not os.path.isdir(ck) and not has_own_checkpoint(cfg):
        raise ConfigError(
            f"checkpoint.load={ck!r} is not a folder; use auto, latest, none or an existing checkpoint folder"
        )
