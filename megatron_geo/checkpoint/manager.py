"""Checkpoint folders: atomic publication, ``latest`` pointer, retention, resume resolution, and the
compatibility check between a checkpoint and the run that loads it.

On disk (``checkpoint.dir``, default ``<train.run_dir>/checkpoints``)::

    step_00000100/      .metadata + __*_*.distcp (torch.distributed.checkpoint) + meta.json
    step_00000200/
    latest              "step_00000200" (rewritten atomically, only after the folder is complete)

A save writes into ``.tmp-step_N``, rank 0 adds ``meta.json`` last, checks in its own view of the folder
that every file the metadata names is there with its full size (:mod:`.verify`), renames the folder to
``step_N`` and then replaces ``latest``; older folders are removed only after that. A crash at any point leaves
the previous complete checkpoint loadable and ``latest`` pointing to it. Each step that only some ranks
run (rank 0 preparing and publishing the folder) ends in a rank agreement (:mod:`.agreement`), so a failure
there is a :class:`CheckpointSaveError` on every rank instead of the others waiting in the next collective.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..config import Config, ConfigError
from ..parallel import collectives as C
from .agreement import CheckpointRankError, agree
from .verify import IncompleteCheckpointError, verify_written

FORMAT = "megatron-geo-dcp-v1"
META = "meta.json"
# Model keys that change parameter shapes: a checkpoint only loads into the same values.
SHAPE_KEYS = ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or os.path.join(cfg.train.run_dir, "checkpoints"))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / META).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir() and is_complete(p)), key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder of ``root`` (None when there is none).

    ``latest`` names the last published one; a complete folder newer than it can only be a save that was
    published (verified and renamed) but stopped before the pointer was rewritten, so the newer folder wins
    and a relaunch never moves it aside as an abandoned timeline. (A roll-back moves later folders out of
    ``root`` first.)
    """
    done = complete_checkpoints(root)
    return done[-1] if done else None


def latest_pointer_problem(root: Path) -> str | None:
    """Why ``root/latest`` cannot be followed (None when it names a complete checkpoint of ``root``)."""
    pointer = root / "latest"
    if not pointer.is_file():  # e.g. a crash between the rename and the pointer update: the newest folder is used
        return None
    name = pointer.read_text().strip()
    if not (name.startswith("step_") and "/" not in name and "\\" not in name):
        return f"{pointer} holds {name[:80]!r}, not the name of a step_* folder of {root}"
    if not is_complete(root / name):
        return f"{pointer} names {name}, which is not a complete checkpoint"
    return None


def resolve_load(cfg: Config, log=None) -> Path | None:
    """The checkpoint folder this run starts from (None: start fresh), per ``checkpoint.load``.

    With ``auto`` a damaged ``latest`` pointer falls back to the newest complete folder (``log`` says so), and
    is an error when there is none (a run is never restarted from step 0 over a damaged checkpoint); with
    ``latest`` it is an error.

    Raises:
        ConfigError: ``latest`` with no complete checkpoint or a damaged pointer, ``auto`` with a damaged pointer
            and no complete checkpoint, or a path that is not a complete checkpoint.
    """
    mode, root = cfg.checkpoint.load, checkpoint_root(cfg)
    if mode == "none":
        return None
    if mode in ("auto", "latest"):
        problem = latest_pointer_problem(root)
        if problem and mode == "latest":
            raise ConfigError(
                f"checkpoint.load=latest but {problem}; point checkpoint.load at a step_* folder, or "
                f"use checkpoint.load=auto (the newest complete checkpoint)"
            )
        found = latest_checkpoint(root)
        if problem and found is None:  # never start over silently on top of a run whose checkpoint is damaged
            raise ConfigError(
                f"checkpoint.load=auto but {problem}, and {root} holds no other complete checkpoint to "
                f"resume from; repair or remove it, or set checkpoint.load=none to start this run "
                f"over from step 0"
            )
        if problem and found is not None and log is not None:
            log(f"checkpoint: {problem}; using the newest complete checkpoint, {found.name}")
        if found is None and mode == "latest":
            raise ConfigError(
                f"checkpoint.load=latest but {root} holds no complete checkpoint; use checkpoint.load="
                f"auto (resume only if there is one) or none"
            )
        return found
    return explicit_checkpoint(mode)


def explicit_checkpoint(mode: str) -> Path:
    """The complete checkpoint an explicit ``checkpoint.load`` path names: a step folder, or a checkpoints
    folder (its newest complete checkpoint).

    Raises:
        ConfigError: the path is not a complete checkpoint and holds none.
    """
    path = Path(mode)
    if (path / "latest").is_file() or (not is_complete(path) and complete_checkpoints(path)):
        found = latest_checkpoint(path)
        if found is not None:
            return found
    if not is_complete(path):
        raise ConfigError(
            f"checkpoint.load={mode!r} is not a complete checkpoint (no {META} and .metadata in it); "
            f"point it at a step_* folder or a checkpoints folder with a 'latest' file"
        )
    return path


def read_meta(path: Path) -> dict:
    """``meta.json`` of a checkpoint folder.

    Raises:
        ConfigError: unreadable or of another format.
    """
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"checkpoint {path}: cannot read {META} ({e}); the folder is damaged or not a megatron-geo checkpoint"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ConfigError(f"checkpoint {path} has format {got!r}, expected {FORMAT!r}")
    missing = [k for k in ("step", "consumed_samples", "dp_size", "tp_size", "config") if k not in meta]
    if missing:
        raise ConfigError(
            f"checkpoint {path}: {META} lacks {', '.join(missing)}; the folder is damaged, load an "
            f"older checkpoint (checkpoint.load=PATH) or start fresh (checkpoint.load=none)"
        )
    for k in ("step", "consumed_samples", "dp_size", "tp_size"):
        v = meta[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if k.endswith("size") else 0):
            raise ConfigError(
                f"checkpoint {path}: {META} has {k}={v!r}, not a valid count; the folder is damaged, "
                f"load an older checkpoint (checkpoint.load=PATH) or start fresh (checkpoint.load=none)"
            )
    if not isinstance(meta["config"], dict):
        raise ConfigError(f"checkpoint {path}: {META} has no config mapping; the folder is damaged")
    return meta


def _holds_optimizer_state(path) -> bool:
    """Whether the checkpoint folder ``path`` has any ``optim/`` entry (True when it cannot be told: the strict
    answer)."""
    if not path:
        return True
    from .safe_reader import SafeFileSystemReader

    try:
        keys = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata is reported by the load itself
        return True
    return any(k.startswith("optim/") for k in keys)


def check_compatible(meta: dict, cfg: Config, dp_size: int, tp_size: int) -> tuple[bool, list[str]]:
    """Whether a checkpoint can resume this run, and what differs.

    Returns:
        ``(same_layout, notes)``: ``same_layout`` when DP and TP sizes are unchanged (error feedback,
        RNG and GeoFP8 transforms are restored only then); ``notes`` are changes worth logging.

    Raises:
        ConfigError: a different model shape, or another optimizer when the checkpoint holds optimizer state
            (naming the key and both values); without optimizer state (an imported model) a change is a note.
    """
    saved = meta["config"]
    for k in SHAPE_KEYS:
        if saved["model"][k] != getattr(cfg.model, k):
            raise ConfigError(
                f"checkpoint {meta.get('path', '')} was saved with model.{k}={saved['model'][k]} but this "
                f"run has model.{k}={getattr(cfg.model, k)}; use the same model shape, or "
                f"checkpoint.load=none to start fresh"
            )
    notes = []
    if saved["optimizer"]["name"] != cfg.optimizer.name and not _holds_optimizer_state(meta.get("path")):
        notes.append(
            f"optimizer.name {saved['optimizer']['name']} -> {cfg.optimizer.name}: the checkpoint holds no "
            f"optimizer state (an import or a step-0 checkpoint), so the new optimizer starts fresh"
        )
    elif saved["optimizer"]["name"] != cfg.optimizer.name:
        raise ConfigError(
            f"checkpoint was saved with optimizer.name={saved['optimizer']['name']} but this run has "
            f"optimizer.name={cfg.optimizer.name}; the optimizer state cannot be converted"
        )
    # keys that change the trajectory (data order, model function, wire numerics, batch, schedule):
    # checkpoint/resume_changes.py
    same = meta["dp_size"] == dp_size and meta["tp_size"] == tp_size
    if not same:
        notes.append(
            f"resharding: saved at DP={meta['dp_size']} TP={meta['tp_size']}, loading at DP={dp_size} TP={tp_size}"
        )
    return same, notes


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, permission lost, a writer killed, any rank failed while
    building its part of the state, or rank 0 does not see every rank's files complete); raised on every
    rank alike. The partial folder was removed and the previous checkpoint is intact, ``latest`` still
    names it. The trainer exits with code 6."""


def _save_failure(tmp: Path, err: BaseException) -> CheckpointSaveError:
    """One line naming the folder and the cause (``no space left on device`` and the like, from the errno of
    the first OSError in the exception chain or the message DCP gathered from the failing rank)."""
    cause: str | None = None
    seen: BaseException | None = err
    while seen is not None and cause is None:
        if isinstance(seen, OSError) and seen.errno:
            cause = os.strerror(seen.errno).lower()
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    for errno_name, words in (
        (28, "no space left on device"),
        (13, "permission denied"),
        (122, "disk quota exceeded"),
        (30, "read-only file system"),
    ):
        if cause is None and (words in text.lower() or f"errno {errno_name}]" in text.lower()):
            cause = words
    first = text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
    where = f" (rank {err.rank})" if isinstance(err, CheckpointRankError) and cause else ""
    advice = (
        "free space or fix the permissions of checkpoint.dir, then relaunch to resume"
        if cause
        else "relaunch to resume from it"
    )
    return CheckpointSaveError(
        f"could not save the checkpoint to {tmp.parent}: {cause or first}{where}; the partial "
        f"folder was removed and the previous checkpoint is intact ({advice})"
    )


def state_failure(root: Path, step: int, err: BaseException) -> CheckpointSaveError:
    """The error of a save that failed before anything was written (building the state dict on some rank)."""
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    return CheckpointSaveError(
        f"could not save the checkpoint of step {step} to {root}: {text}; nothing was "
        f"written, the previous checkpoint and 'latest' are unchanged (relaunch to resume "
        f"from it)"
    )


def save_checkpoint(
    root: Path,
    step: int,
    state: dict,
    meta: dict,
    keep_latest: int,
    group,
    is_main: bool,
    device: torch.device | None = None,
) -> Path:
    """Write ``state`` (a DCP state dict; every rank its own part) as ``root/step_N`` and publish it.

    Collective over ``group`` (the world). ``device`` is ``pctx.device`` (the device of the rank-agreement
    flags: CUDA for NCCL; None picks the current CUDA device for an NCCL group, else the CPU). Returns the
    final folder.

    Raises:
        CheckpointSaveError: on every rank when any rank failed: preparing the folder (rank 0), writing its
            files (DCP gathers the failure) or publishing them (rank 0), or when rank 0's view of the written
            folder lacks a file or holds one shorter than the metadata says (a ``checkpoint.dir`` not shared by
            every node, a lost write). The partial ``.tmp-step_N`` folder is removed, the previous checkpoint
            and ``latest`` stay, and no older checkpoint is pruned.
    """
    import torch.distributed.checkpoint as dcp

    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if C.required_device_type(group) == "cuda"
            else torch.device("cpu")
        )
    name = step_dir_name(step)
    tmp, final = root / f".tmp-{name}", root / name
    err = None
    if is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except Exception as e:  # noqa: BLE001 - the other ranks wait for the folder
            err = e
    try:
        agree(err, group, device, "preparing the checkpoint folder")  # also the barrier: the folder exists
    except CheckpointRankError as e:
        raise _save_failure(tmp, e) from None
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # DCP warns on each ShardedTensor (see state.py)
            dcp.save(state, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as e:  # DCP raises on every rank alike (it gathers every outcome;
        # its CheckpointException is a BaseException)
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failure(tmp, e) from None
    C.barrier(group)  # every rank's files are written
    err, text = None, ""
    if is_main:
        try:
            text = json.dumps(
                dict(
                    meta,
                    format=FORMAT,
                    step=step,
                    saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    save_seconds=round(time.perf_counter() - t0, 3),
                    torch=torch.__version__,
                ),
                indent=1,
            )
            _write_atomic(tmp / META, text)
        except Exception as e:  # noqa: BLE001 - the other ranks wait for meta.json
            shutil.rmtree(tmp, ignore_errors=True)
            err = e
    try:
        agree(err, group, device, f"writing {META}")
    except CheckpointRankError as e:
        raise _save_failure(tmp, e) from None
    _verify_before_publishing(tmp, {META: len(text.encode())}, group, device, is_main)
    err = None
    if is_main:
        try:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_atomic(root / "latest", name + "\n")
            prune(root, keep_latest)
        except Exception as e:  # noqa: BLE001 - the other ranks wait for the publication
            shutil.rmtree(tmp, ignore_errors=True)
            err = e
    try:
        agree(err, group, device, "publishing the checkpoint")
    except CheckpointRankError as e:
        raise _save_failure(tmp, e) from None
    return final


def _verify_before_publishing(tmp: Path, own: dict[str, int], group, device: torch.device, is_main: bool) -> None:
    """Rank 0 checks the written folder ``tmp`` in its own view (:func:`.verify.verify_written`; ``own``:
    ``{name: bytes}`` of the files rank 0 wrote itself) and every rank agrees on the outcome. Collective over
    ``group``.

    Raises:
        CheckpointSaveError: on every rank when a file is missing or short (naming the files and the ranks
            that wrote them) or the check failed; each rank removes its view of ``tmp``, so nothing is published
            and no older checkpoint is pruned.
    """
    err = None
    if is_main:
        try:
            verify_written(tmp, own)
        except Exception as e:  # noqa: BLE001 - the other ranks wait for the check
            err = e
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        agree(err, group, device, "checking the written checkpoint files")
    except CheckpointRankError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a rank's own files on a folder rank 0 does not see
        if e.error_type != IncompleteCheckpointError.__name__:
            raise _save_failure(tmp, e) from None
        raise CheckpointSaveError(
            f"could not save the checkpoint to {tmp.parent}: {e.message.splitlines()[0]}; nothing was published "
            f"('latest' and the older checkpoints are unchanged) and the partial folder was removed. checkpoint.dir "
            f"must be one folder that every node sees (a shared file system, not a node-local disk) with room for "
            f"every rank's files: fix it, then relaunch to resume"
        ) from None


def abandon_later(root: Path, step: int) -> list[tuple[Path, Path | None]]:
    """Start a new timeline at ``step``: move every complete checkpoint of ``root`` with a later step into
    ``root/abandoned/`` (and remove later partial ``.tmp-step_*`` folders) so that retention and
    ``checkpoint.load=auto`` never see them, and point ``latest`` at the newest checkpoint that remains (or
    remove it). Returns ``[(from, to or None when removed), ...]``."""
    if not root.is_dir():
        return []
    later = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.removeprefix(".tmp-").startswith("step_")
        and p.name.removeprefix(".tmp-")[len("step_") :].isdigit()
        and int(p.name.removeprefix(".tmp-")[len("step_") :]) > step
    ]
    moved: list[tuple[Path, Path | None]] = []
    if later:
        aside = root / "abandoned"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for p in sorted(later):
            if p.name.startswith(".tmp-"):  # an interrupted save: nothing loadable, removed
                shutil.rmtree(p, ignore_errors=True)
                moved.append((p, None))
                continue
            aside.mkdir(exist_ok=True)
            dest = aside / f"{p.name}-{stamp}"
            os.replace(p, dest)
            moved.append((p, dest))
        done = complete_checkpoints(root)
        if done:
            _write_atomic(root / "latest", done[-1].name + "\n")
        elif (root / "latest").exists():
            (root / "latest").unlink()
    return moved


def prune(root: Path, keep_latest: int) -> list[Path]:
    """Remove complete checkpoints older than the newest ``keep_latest`` (0 keeps all), never the one
    ``latest`` names; also removes leftovers of interrupted saves older than the newest complete one."""
    done = complete_checkpoints(root)
    latest = latest_checkpoint(root)
    removed = []
    if keep_latest > 0:
        for p in done[:-keep_latest]:
            if p != latest:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    if latest is not None:
        for p in root.glob(".tmp-step_*"):
            if p.name[len(".tmp-") :] < latest.name:
                shutil.rmtree(p, ignore_errors=True)
    return removed
