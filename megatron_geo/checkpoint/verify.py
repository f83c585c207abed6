"""Check a written checkpoint folder before it is published: every file its metadata names must be there,
with at least the bytes the metadata says it holds, as the publishing rank (rank 0, which also loads it
later) sees the folder.

A DCP save succeeds on every rank as soon as each rank wrote its own ``__<rank>_<n>.distcp`` files into its
own view of the folder. When ``checkpoint.dir`` is not one folder shared by every node (a node-local disk, a
mount missing on one node), rank 0's view lacks the other ranks' files; a disk that silently dropped the
end of a file leaves it shorter than the metadata says. Either way the folder must not become ``latest``,
and older checkpoints must not be pruned for it.

The size a data file needs is the largest ``offset + length`` of the ``.metadata`` storage entries
(``MetadataIndex -> _StorageInfo(relative_path, offset, length)``) that point into it.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from .safe_reader import UnsafeCheckpointError, _RestrictedUnpickler

DCP_METADATA = ".metadata"
_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_SHOWN = 6  # problems spelled out in the error message (the rest are counted)


@dataclass(frozen=True)
class FileProblem:
    """One file of a checkpoint folder that is missing, short or unreadable.

    Attributes:
        name: the path relative to the folder (e.g. ``__1_0.distcp``).
        size: bytes found (-1: missing or not a regular file).
        need: bytes it must have at least.
        detail: why it is unreadable (empty when it is missing or short).
    """

    name: str
    size: int
    need: int
    detail: str = ""

    def describe(self) -> str:
        by = f" (written by rank {writer_rank(self.name)})"
        if self.detail:
            return f"{self.name} is unreadable ({self.detail}){by}"
        if self.size < 0:
            return f"{self.name} is missing{by}"
        return f"{self.name} has {self.size:,} of {self.need:,} bytes{by}"


class IncompleteCheckpointError(RuntimeError):
    """A written checkpoint folder lacks files, or holds files shorter than its metadata says.

    Attributes:
        folder: the checkpoint folder checked.
        problems: every :class:`FileProblem` found.
    """

    def __init__(self, folder: Path, problems: list[FileProblem]):
        self.folder, self.problems = folder, problems
        shown = "; ".join(p.describe() for p in problems[:_SHOWN])
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        ranks = sorted({writer_rank(p.name) for p in problems})
        who = f" (written by rank(s) {', '.join(map(str, ranks))})"
        super().__init__(f"{folder.name} is incomplete where rank 0 reads it{who}: {shown}{more}")


def writer_rank(name: str) -> int:
    """The rank that wrote a checkpoint file: ``N`` of DCP's ``__N_M.distcp`` (the writer's rank in the
    save's process group), 0 for any other file (``.metadata`` is written by DCP's coordinator, rank 0, and
    ``meta.json`` by rank 0)."""
    m = _DATA_FILE.fullmatch(name)
    return int(m.group(1)) if m else 0


def file_size(path: Path) -> int:
    """Bytes of the regular file ``path``, -1 when it is missing or not a regular file.

    The file is opened (not only stat'ed): on NFS an open revalidates the cached attributes, so a file
    that another node has just closed shows its full size.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return -1
    try:
        st = os.fstat(fd)
        return st.st_size if stat.S_ISREG(st.st_mode) else -1
    finally:
        os.close(fd)


def read_dcp_metadata(folder: Path) -> Metadata:
    """The DCP ``.metadata`` of ``folder``, unpickled with the allow-list of :mod:`.safe_reader`.

    Raises:
        OSError: the file is missing or cannot be read.
        UnsafeCheckpointError: it is damaged or does not hold DCP metadata.
    """
    with open(folder / DCP_METADATA, "rb") as f:
        try:
            metadata = _RestrictedUnpickler(f).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - garbage bytes fail in many ways
            raise UnsafeCheckpointError(f"{type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def required_sizes(metadata: Metadata) -> dict[str, int]:
    """``{relative_path: bytes}`` every data file of ``metadata`` must have at least: the largest
    ``offset + length`` of the storage entries in it."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    return need


def short_files(folder: Path, need: dict[str, int]) -> list[FileProblem]:
    """The files of ``need`` (``{relative_path: bytes}``) that ``folder`` lacks or holds with fewer bytes,
    in name order."""
    out = []
    for name in sorted(need):
        size = file_size(folder / name)
        if size < need[name]:
            out.append(FileProblem(name, size, need[name]))
    return out


def verify_written(folder: Path, own: dict[str, int]) -> None:
    """Check, in this process's view of ``folder``, that the checkpoint is complete: ``.metadata`` exists and
    unpickles, every data file it names has at least the bytes its entries end at, and each file of ``own``
    (``{name: bytes written}``, e.g. ``{"meta.json": 812}``) has at least its bytes.

    Raises:
        IncompleteCheckpointError: naming every missing, short or unreadable file and the ranks that wrote them.
    """
    problems = short_files(folder, own)
    try:
        metadata = read_dcp_metadata(folder)
    except FileNotFoundError:
        problems.append(FileProblem(DCP_METADATA, -1, 1))
    except (OSError, UnsafeCheckpointError) as e:
        problems.append(
            FileProblem(
                DCP_METADATA, file_size(folder / DCP_METADATA), 1, (getattr(e, "strerror", None) or str(e))[:120]
            )
        )
    else:
        problems += short_files(folder, required_sizes(metadata))
    if problems:
        raise IncompleteCheckpointError(folder, problems)
