#!/usr/bin/env python
"""Rewrite megatron-geo's earlier MGEOIDX ``PREFIX.idx`` files as Megatron-Core's MMIDIDX index, in place.

The package reads MMIDIDX only and refuses an MGEOIDX index, naming this tool. The ``.bin`` is left untouched (both
formats describe the same token file); the new index keeps the dtype (uint16 or int32) and has one sequence per
document. An index that already is MMIDIDX is reported and left alone. Every PREFIX is checked first (the checks
of opening the dataset): a missing, truncated or corrupt one is one ``error:`` line and exit code 2, and then
nothing is rewritten. Each index is replaced atomically (temporary file, fsync, rename). MMIDIDX records no
vocabulary size: the one the old index recorded is printed, not kept.

The MGEOIDX ``PREFIX.idx`` (read here only), little-endian:

    magic       8 bytes   b"MGEOIDX\\0"
    version     uint32    1
    dtype_code  uint32    1 = uint16 (vocabularies of 1..65536 ids), 2 = int32 (up to 2**31)
    vocab_size  uint64    size of the tokenizer vocabulary the ids come from
    num_docs    uint64
    sizes       int64[num_docs]   document lengths in tokens
    offsets     int64[num_docs]   document start offsets in tokens (into .bin)

Example:
  python tools/convert_index.py data/train data/valid
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from typing import NamedTuple

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.data.indexed_dataset import MMIDIDX_MAGIC, IndexedDataset, write_mmidx_index  # noqa: E402

MGEOIDX_MAGIC = b"MGEOIDX\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # 32 bytes
DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<i4")}  # MGEOIDX dtype codes
INT32_MAX = 2**31 - 1
CHUNK = 1 << 22  # entries per step when checking large tables


class Legacy(NamedTuple):
    """A checked MGEOIDX index: the ``.bin``'s ``dtype``, the recorded ``vocab_size``, ``num_docs`` and ``sizes``
    (int64 [num_docs], tokens per document, memory-mapped)."""

    dtype: np.dtype
    vocab_size: int
    num_docs: int
    sizes: np.ndarray


def _fix(prefix: str) -> str:
    return f"re-run tools/preprocess_data.py --output-prefix {prefix} to rebuild it"


def _writer_dtype(vocab_size: int) -> np.dtype | None:
    """The dtype the MGEOIDX writer stored for ``vocab_size`` (None: no valid dtype)."""
    if vocab_size <= 0 or vocab_size > 2**31:
        return None
    return DTYPES[1] if vocab_size <= 2**16 else DTYPES[2]


def read_mgeo_header(idx_path: str, prefix: str, head: bytes, idx_len: int) -> tuple[np.dtype, int, int]:
    """``(dtype, vocab_size, num_docs)`` of an MGEOIDX ``idx_path`` of ``idx_len`` bytes starting with ``head``.

    Raises:
        ValueError: truncated, a bad version or dtype code, a dtype its writer would not pick for the recorded
            vocabulary, or a size its document count does not imply (one line naming the file and the fix).
    """
    if len(head) < HEADER.size:
        raise ValueError(
            f"{idx_path!r} is truncated: {idx_len} bytes, shorter than the {HEADER.size}-byte MGEOIDX header; "
            f"{_fix(prefix)}"
        )
    _, version, code, vocab_size, num_docs = HEADER.unpack(head[: HEADER.size])
    if version != VERSION:
        raise ValueError(f"{idx_path!r} has MGEOIDX format version {version}, expected {VERSION}; {_fix(prefix)}")
    if code not in DTYPES:
        raise ValueError(
            f"{idx_path!r} has unknown MGEOIDX dtype code {code}, expected 1 (uint16) or 2 (int32); {_fix(prefix)}"
        )
    if DTYPES[code] != _writer_dtype(vocab_size):
        raise ValueError(
            f"{idx_path!r} records vocab_size={vocab_size} with dtype code {code} "
            f"({DTYPES[code].name}); the MGEOIDX writer stored a vocabulary of 1..65536 ids as code 1 and up to "
            f"2**31 as code 2 (corrupt header); {_fix(prefix)}"
        )
    expected = HEADER.size + 16 * num_docs
    if idx_len != expected:
        raise ValueError(
            f"{idx_path!r} is truncated or corrupt: {idx_len} bytes, expected {expected} "
            f"({HEADER.size}-byte header + 16 bytes x {num_docs} documents); {_fix(prefix)}"
        )
    return DTYPES[code], int(vocab_size), int(num_docs)


def check_document_table(idx_path: str, prefix: str, sizes: np.ndarray, offsets: np.ndarray) -> int:
    """Documents have sizes >= 0 and follow each other from token offset 0; returns the token count.

    Args:
        sizes, offsets: int64 [num_docs], tokens per document and token offset of each (memory-mapped is fine:
            read in chunks).

    Raises:
        ValueError: naming the file, the first bad document and the fix.
    """
    done = 0
    for start in range(0, sizes.size, CHUNK):
        sz = np.asarray(sizes[start : start + CHUNK], dtype=np.int64)
        off = np.asarray(offsets[start : start + CHUNK], dtype=np.int64)
        bad = np.flatnonzero(sz < 0)
        if not bad.size:
            ends = np.cumsum(sz) + done
            bad = np.flatnonzero(off != ends - sz)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{idx_path!r} has inconsistent document sizes/offsets (first at document {start + i}: size "
                f"{sz[i]}, offset {off[i]}); {_fix(prefix)}"
            )
        done = int(ends[-1])
    return done


def _looks_mgeo(head: bytes) -> bool:
    """The file starts with the MGEOIDX magic, or is too short to hold it and starts like it (not like MMIDIDX's)."""
    n = min(len(head), len(MGEOIDX_MAGIC))
    return n > 0 and head[:n] == MGEOIDX_MAGIC[:n] and not MMIDIDX_MAGIC.startswith(head)


def check_convertible(prefix: str) -> Legacy | None:
    """Validate ``PREFIX.idx``/``PREFIX.bin`` (every check of opening them) before :func:`convert_to_mmidx`.

    Returns the MGEOIDX index to convert, or None when it already is MMIDIDX (checked by the package's reader).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a bad or inconsistent file, or an MGEOIDX document longer than 2**31 - 1 tokens (MMIDIDX
            stores int32 lengths).
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p!r} not found; give the PREFIX of an existing PREFIX.bin/PREFIX.idx pair")
    idx_len = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(HEADER.size)
    if not _looks_mgeo(head):
        IndexedDataset(prefix)  # MMIDIDX: the package's checks; anything else: its error
        return None
    dtype, vocab_size, num_docs = read_mgeo_header(idx_path, prefix, head, idx_len)
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    sizes = np.frombuffer(raw, "<i8", num_docs, HEADER.size) if num_docs else np.empty(0, np.int64)
    offsets = np.frombuffer(raw, "<i8", num_docs, HEADER.size + 8 * num_docs) if num_docs else sizes
    num_tokens = check_document_table(idx_path, prefix, sizes, offsets)
    bin_len = os.path.getsize(bin_path)
    if bin_len != num_tokens * dtype.itemsize:
        raise ValueError(
            f"{bin_path!r} is truncated or corrupt: {bin_len} bytes, but {idx_path!r} lists "
            f"{num_tokens} tokens x {dtype.itemsize} bytes = {num_tokens * dtype.itemsize} bytes; {_fix(prefix)}"
        )
    for start in range(0, num_docs, CHUNK):
        big = np.flatnonzero(sizes[start : start + CHUNK] > INT32_MAX)
        if big.size:
            doc = start + int(big[0])
            raise ValueError(
                f"{idx_path!r}: document {doc} has {int(sizes[doc])} tokens, more than the 2**31 - 1 an MMIDIDX "
                f"index records per sequence; {_fix(prefix)}"
            )
    return Legacy(dtype, vocab_size, num_docs, sizes)


def convert_to_mmidx(prefix: str, legacy: Legacy) -> None:
    """Rewrite the MGEOIDX ``PREFIX.idx`` that :func:`check_convertible` returned ``legacy`` for as MMIDIDX in
    place: same dtype (uint16 -> code 8, int32 -> code 4), one sequence per document, ``document_indices =
    0..num_docs``; the recorded vocab_size is dropped (MMIDIDX has no field for it). The ``.bin`` is not touched.
    Written to a temporary file, fsynced, then ``os.replace``d, so a crash leaves the old index.

    Raises:
        OSError: the index cannot be written.
    """
    idx_path = prefix + ".idx"
    tmp = f"{idx_path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write_mmidx_index(f, legacy.dtype, legacy.sizes, np.arange(legacy.num_docs + 1, dtype=np.int64))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, idx_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", nargs="+", metavar="PREFIX", help="dataset path without .bin/.idx")
    args = ap.parse_args(argv)
    checked: dict[str, Legacy | None] = {}
    # a path given with its .idx / .bin suffix names the same pair (tab completion gives one)
    args.prefix = [p[: -len(ext)] if (ext := os.path.splitext(p)[1]) in (".idx", ".bin") else p for p in args.prefix]
    for prefix in args.prefix:
        try:
            checked[prefix] = check_convertible(prefix)
        except (OSError, ValueError) as err:
            print(f"convert_index.py: error: {err}", file=sys.stderr)
            return 2
    for prefix, c in checked.items():
        if c is None:
            print(f"{prefix}.idx is already MMIDIDX: left as it is")
            continue
        try:
            convert_to_mmidx(prefix, c)
        except OSError as err:
            print(f"convert_index.py: error: {err}", file=sys.stderr)
            return 2
        print(
            f"{prefix}.idx: MGEOIDX -> MMIDIDX ({c.num_docs} documents, {c.dtype.name} tokens; "
            f"the recorded vocab_size={c.vocab_size} is not kept: MMIDIDX has no field for it)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
