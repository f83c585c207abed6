"""Start-up check that the checkpoint folder is one folder that every rank sees.

Every rank writes its own part of a checkpoint into its view of ``checkpoint.dir``, and rank 0 publishes
and later loads the folder from its own view. On a folder that is not shared by every node (a node-local
disk, a mount missing on one node) each node would keep only its own ranks' files. So before training,
rank 0 writes a probe file holding a fresh random token into the folder, every rank reads it after a
barrier, the ranks agree on who found the token, and rank 0 removes the probe again.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from . import agreement
from .manager import checkpoint_root

# what a rank found where the probe should be
SEEN, MISSING, OTHER, UNREADABLE = 0, 1, 2, 3
_FOUND = {MISSING: "no such file", OTHER: "another token", UNREADABLE: "unreadable"}


def checkpointing_in_use(cfg: Config) -> bool:
    """Whether the run saves checkpoints on a schedule (``checkpoint.interval``, ``checkpoint.save_at_end``,
    ``train.exit_interval``) or resumes from ``checkpoint.dir`` (``checkpoint.load`` auto or latest).

    A run with none of these still saves on a stop signal or a non-finite stop; those saves are checked
    when they publish (:func:`megatron_geo.checkpoint.verify.verify_written`)."""
    ck = cfg.checkpoint
    return bool(ck.interval or ck.save_at_end or cfg.train.exit_interval or ck.load in ("auto", "latest"))


def probe_name(token: int) -> str:
    return f".shared-dir-probe-{token:016x}"


def _probe_text(token: int) -> str:
    return f"megatron-geo checkpoint folder probe {token}\n"


def write_probe(root: Path, token: int) -> Path:
    """Create ``root`` if needed and write the probe file of ``token`` into it (fsync'ed); returns its path.

    Raises:
        OSError: the folder cannot be created or written.
    """
    root.mkdir(parents=True, exist_ok=True)
    path = root / probe_name(token)
    with open(path, "w") as f:
        f.write(_probe_text(token))
        f.flush()
        os.fsync(f.fileno())
    return path


def read_probe(root: Path, token: int) -> int:
    """What this rank finds at ``root``'s probe file of ``token``: SEEN, MISSING, OTHER or UNREADABLE."""
    try:
        text = (root / probe_name(token)).read_text()
    except FileNotFoundError:
        return MISSING
    except (OSError, UnicodeDecodeError):
        return UNREADABLE
    return SEEN if text == _probe_text(token) else OTHER


def check_shared_folder(root: Path, where: str, group, device: torch.device) -> None:
    """Raise on every rank of ``group`` unless every rank finds, in its own ``root``, the probe file that
    rank 0 wrote there. Collective over ``group``; ``device`` is ``pctx.device`` (the device of the agreement
    flags). ``where`` names the setting in the messages (e.g. ``"checkpoint.dir"``).

    Raises:
        ConfigError: on every rank: rank 0 could not write the probe (names the folder and the cause), or
            some ranks could not read it (names the folder and those ranks, with the fix).
    """
    me = dist.get_rank(group)
    token, err = 0, None
    if me == 0:
        token = secrets.randbits(62) + 1
        try:
            write_probe(root, token)
        except Exception as e:  # noqa: BLE001 - the other ranks wait in the agreement
            err = e
    try:
        agreement.agree(err, group, device, f"writing a probe file into {where}")  # also the barrier
    except agreement.CheckpointRankError as e:
        raise ConfigError(
            f"{where} {str(root)!r}: rank 0 cannot write into it ({e.message.splitlines()[0][:200]}); "
            f"choose a writable folder that every node mounts"
        ) from None
    shared = agreement.all_gather_ints([token], group, device)[0][0]
    found = [f for (f,) in agreement.all_gather_ints([read_probe(root, shared)], group, device)]
    if me == 0:  # every rank has read it (the all-gather above)
        try:
            (root / probe_name(token)).unlink()
        except OSError:
            pass
    bad = [r for r, f in enumerate(found) if f != SEEN]
    if bad:
        ranks = ", ".join(f"{dist.get_global_rank(group, r)} ({_FOUND[found[r]]})" for r in bad[:16])
        more = f" and {len(bad) - 16} more" if len(bad) > 16 else ""
        raise ConfigError(
            f"{where} {str(root)!r} (as rank {dist.get_global_rank(group, me)} sees it) is not one "
            f"folder that every rank sees: rank 0 wrote the probe file {probe_name(shared)} into it and "
            f"rank(s) {ranks}{more} could not read it there, so their checkpoint files would be "
            f"missing from rank 0's folder; set checkpoint.dir to a folder that every node mounts "
            f"(e.g. on the shared file system), not a node-local disk"
        )


def check_checkpoint_dir(cfg: Config, pctx) -> None:
    """:func:`check_shared_folder` for the run's checkpoint folder when the run uses checkpoints
    (:func:`checkpointing_in_use`) and has more than one process (not on torch's ``fake`` process group of
    dry runs: it has no other processes). Collective over ``pctx.world_group``.

    Raises:
        ConfigError: see :func:`check_shared_folder`.
    """
    if pctx.world_size < 2 or not checkpointing_in_use(cfg) or str(dist.get_backend(pctx.world_group)) == "fake":
        return
    where = "checkpoint.dir" if cfg.checkpoint.dir else "the checkpoint folder of train.run_dir"
    check_shared_folder(checkpoint_root(cfg), where, pctx.world_group, pctx.device)
