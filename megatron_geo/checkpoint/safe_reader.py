"""A torch.distributed.checkpoint reader that never unpickles arbitrary objects.

DCP's ``FileSystemReader`` reads the ``.metadata`` file with plain ``pickle.load``; a checkpoint from an
untrusted place could run code that way. This reader unpickles it with an allow-list of the classes DCP
metadata is made of (the dataclasses of ``torch.distributed.checkpoint.metadata``, ``torch.Size`` and
dtypes, paths); anything else is an error naming the class. Tensor data is read by DCP itself
(``torch.load(weights_only=True)`` for the byte entries, raw storage for tensors).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "pathlib",
    "collections",
}
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch", "device")}


class UnsafeCheckpointError(ValueError):
    """The checkpoint metadata names a class outside the allow-list, or a data file is truncated."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        ok = (
            module in _ALLOWED_MODULES
            or (module, name) in _ALLOWED
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not ok:
            raise UnsafeCheckpointError(
                f"checkpoint metadata refers to {module}.{name}, which is not part of "
                f"torch.distributed.checkpoint metadata; refusing to load it"
            )
        return super().find_class(module, name)


def _check_file_sizes(metadata: Metadata, metadata_path) -> None:
    """Every data file must be at least as long as the last byte the metadata says it holds.

    Raises:
        UnsafeCheckpointError: a data file is missing or truncated (names it, with both sizes).
    """
    folder = os.path.dirname(str(metadata_path))
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), end)
    for rel, end in need.items():
        p = os.path.join(folder, rel)
        size = os.path.getsize(p) if os.path.isfile(p) else -1
        if size < end:
            what = "is missing" if size < 0 else f"has {size:,} bytes but its entries end at byte {end:,}"
            raise UnsafeCheckpointError(
                f"checkpoint data file {p} {what}: the checkpoint is truncated or "
                f"incomplete; use an older one (checkpoint.load=PATH of another step_* "
                f"folder) or start fresh (checkpoint.load=none)"
            )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _RestrictedUnpickler(f).load()
            except (
                pickle.UnpicklingError,
                EOFError,
                AttributeError,
                ImportError,
                ValueError,
                TypeError,
                KeyError,
                IndexError,
                UnicodeDecodeError,
            ) as e:  # garbage bytes fail in any of these ways
                raise UnsafeCheckpointError(
                    f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e}); the "
                    f"checkpoint is damaged: use an older one (checkpoint.load=PATH of another "
                    f"step_* folder) or start fresh (checkpoint.load=none)"
                ) from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} does not hold DCP metadata (got {type(metadata).__name__})")
        _check_file_sizes(metadata, path)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata
