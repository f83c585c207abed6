"""What identifies a dataset's files between launches: recorded in every checkpoint, compared on resume, so that a
prefix whose files were rewritten on a shared disk (re-tokenized, re-shuffled, truncated by a failed copy) is a
refused resume, not a silent change of the documents a run trains on."""

from __future__ import annotations

import hashlib
import os

_WHOLE = 64 << 20  # an index up to this size is hashed whole; a larger one by its first and last _WHOLE / 2 bytes


def _digest(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _WHOLE:
            h.update(f.read())
        else:
            h.update(f.read(_WHOLE // 2))
            f.seek(size - _WHOLE // 2)
            h.update(f.read(_WHOLE // 2))
    return h.hexdigest()[:16]


def dataset_identity(prefix: str) -> dict:
    """``{"prefix", "idx_bytes", "bin_bytes", "idx_sha256"}`` of ``PREFIX.idx`` / ``PREFIX.bin``.

    The index holds every sequence length (and its byte offset), so a re-tokenized or re-ordered corpus changes
    its digest; the ``.bin`` is identified by its size (hashing terabytes at every start is not an option).
    ``prefix`` is made absolute; a digest is 16 hex digits of SHA-256 (of the whole ``.idx`` up to 64 MiB, else
    of its first and last 32 MiB).

    Raises:
        OSError: a file cannot be read.
    """
    prefix = os.path.abspath(os.path.expanduser(prefix))
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_bytes = os.path.getsize(idx)
    return {
        "prefix": prefix,
        "idx_bytes": idx_bytes,
        "bin_bytes": os.path.getsize(bin_),
        "idx_sha256": _digest(idx, idx_bytes),
    }


def identity_changes(saved: list[dict], now: list[dict]) -> list[str]:
    """Differences between two lists of :func:`dataset_identity` records (a checkpoint's and this launch's),
    matched by prefix in order; one line per difference, empty when the same files are read."""
    out = []
    if [s.get("prefix") for s in saved] != [n.get("prefix") for n in now]:
        return []  # other prefixes: the config keys' own comparison reports that
    for s, n in zip(saved, now, strict=True):
        diffs = [
            f"{k} {s.get(k)} -> {n.get(k)}" for k in ("idx_bytes", "bin_bytes", "idx_sha256") if s.get(k) != n.get(k)
        ]
        if diffs:
            out.append(f"{n['prefix']}: {', '.join(diffs)}")
    return out
