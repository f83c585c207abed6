"""Indexed token dataset on disk: ``PREFIX.bin`` + ``PREFIX.idx``.

``PREFIX.bin``: the token ids of all documents, concatenated in order, as raw
little-endian ``uint16`` (when ``vocab_size <= 65536``) or ``int32``.

``PREFIX.idx`` (little-endian)::

    magic       8 bytes   b"MGEOIDX\\0"
    version     uint32    1
    dtype_code  uint32    1 = uint16, 2 = int32
    vocab_size  uint64    size of the tokenizer vocabulary the ids come from
    num_docs    uint64
    sizes       int64[num_docs]   document lengths in tokens
    offsets     int64[num_docs]   document start offsets in tokens (into .bin)

Opening (and :func:`check_dataset_files`, the start-up check) validates all of it: magic, version, dtype code
against the vocabulary size, the ``.idx`` size its document count implies, the document table, and the ``.bin``
size the table implies. A Megatron-LM index (magic ``MMIDIDX``) is recognised and refused by name.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

import numpy as np

MAGIC = b"MGEOIDX\0"
VERSION = 1
# Megatron-LM's MMapIndexedDataset index: another layout (9-byte magic, then <Q version, <B dtype code, <Q sequence
# count, <Q document count, then the arrays), recognised only to say so.
MEGATRON_LM_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest storage dtype for ids in ``[0, vocab_size)``: uint16 or int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be positive.")
    if vocab_size > 2**31:
        raise ValueError(f"vocab_size={vocab_size} does not fit int32 token ids.")
    return _DTYPES[1] if vocab_size <= 2**16 else _DTYPES[2]


class IndexedDatasetBuilder:
    """Write documents to ``PREFIX.bin``/``PREFIX.idx``.

    Data goes to temporary files that ``finalize()`` renames into place, so a crash
    never leaves a half-written dataset under the final names. Usable as a context
    manager: on exception the temporary files are removed, otherwise it finalizes.
    """

    def __init__(self, prefix: str, vocab_size: int):
        self.prefix = str(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin = self.prefix + ".bin" + tag
        self._tmp_idx = self.prefix + ".idx" + tag
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 -- written by add_document until finalize closes it
        self._sizes: list[int] = []

    def add_document(self, ids) -> None:
        """Append one document: a sequence of int token ids (list or 1-D array).

        Raises ValueError if an id is outside ``[0, vocab_size)`` or the input is not 1-D.
        """
        if self._bin is None:
            raise ValueError(f"IndexedDatasetBuilder({self.prefix!r}) is already finalized.")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"add_document expects a 1-D sequence of ids, got shape {arr.shape}.")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"add_document expects integer ids, got dtype {arr.dtype}.")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"token id {lo if lo < 0 else hi} outside [0, {self.vocab_size}); "
                    f"the builder's vocab_size must match the tokenizer."
                )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(int(arr.size))

    def finalize(self) -> None:
        """Write the index and atomically move both files to their final names."""
        if self._bin is None:
            return
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._bin = None
        sizes = np.asarray(self._sizes, dtype="<i8")
        offsets = np.zeros_like(sizes)
        if sizes.size:
            np.cumsum(sizes[:-1], out=offsets[1:])
        code = next(c for c, d in _DTYPES.items() if d == self.dtype)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, code, self.vocab_size, sizes.size))
            f.write(sizes.tobytes())
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(self._tmp_idx, self.prefix + ".idx")

    def abort(self) -> None:
        """Discard everything written so far (removes the temporary files)."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        for p in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexHeader(NamedTuple):
    """The validated header of a ``PREFIX.idx``: storage dtype of the ``.bin``, vocabulary size, document count."""

    dtype: np.dtype
    vocab_size: int
    num_docs: int


def _fix(prefix: str) -> str:
    return f"re-run tools/preprocess_data.py --output-prefix {prefix} to rebuild it"


def read_index_header(idx_path: str, prefix: str) -> IndexHeader:
    """Read and check the header of ``idx_path`` against its own size.

    Checks the magic (a Megatron-LM index is named as such), the version, the dtype code (and that it is the one
    the builder picks for the recorded vocabulary size) and that the file is exactly as long as its document
    count implies (32-byte header + 16 bytes per document). ``prefix`` only goes into the fix of the message.

    Raises:
        ValueError: one line naming the file, what was expected and what was found, and the fix.
        OSError: the file cannot be read.
    """
    idx_len = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER.size)
    if head[: len(MEGATRON_LM_MAGIC)] == MEGATRON_LM_MAGIC:
        raise ValueError(
            f"{idx_path!r} is a Megatron-LM indexed dataset (magic {MEGATRON_LM_MAGIC!r}), a format "
            f"megatron-geo does not read (yet); tokenize the text again with tools/preprocess_data.py "
            f"--output-prefix {prefix}"
        )
    if len(head) < _HEADER.size:
        raise ValueError(
            f"{idx_path!r} is truncated: {idx_len} bytes, shorter than the {_HEADER.size}-byte header; {_fix(prefix)}"
        )
    magic, version, code, vocab_size, num_docs = _HEADER.unpack(head)
    if magic != MAGIC:
        raise ValueError(
            f"{idx_path!r} is not a megatron-geo index (bad magic {magic!r}, expected {MAGIC!r}); {_fix(prefix)}"
        )
    if version != VERSION:
        raise ValueError(f"{idx_path!r} has format version {version}, expected {VERSION}; {_fix(prefix)}")
    if code not in _DTYPES:
        raise ValueError(
            f"{idx_path!r} has unknown dtype code {code}, expected 1 (uint16) or 2 (int32); {_fix(prefix)}"
        )
    try:
        expected_dtype = dtype_for_vocab(vocab_size)
    except ValueError:
        expected_dtype = None
    if _DTYPES[code] != expected_dtype:
        raise ValueError(
            f"{idx_path!r} records vocab_size={vocab_size} with dtype code {code} "
            f"({_DTYPES[code].name}); the writer stores a vocabulary of 1..65536 ids as code 1 and up to "
            f"2**31 as code 2 (corrupt header); {_fix(prefix)}"
        )
    expected = _HEADER.size + 16 * num_docs
    if idx_len != expected:
        raise ValueError(
            f"{idx_path!r} is truncated or corrupt: {idx_len} bytes, expected {expected} "
            f"({_HEADER.size}-byte header + 16 bytes x {num_docs} documents); {_fix(prefix)}"
        )
    return IndexHeader(_DTYPES[code], int(vocab_size), int(num_docs))


def _map_index(idx_path: str, num_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """``sizes`` and ``offsets`` (int64 [num_docs] each), memory-mapped from a checked index."""
    if num_docs == 0:
        return np.empty(0, dtype="<i8"), np.empty(0, dtype="<i8")
    arr = np.memmap(idx_path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(2 * num_docs,))
    return arr[:num_docs], arr[num_docs:]


def check_document_table(idx_path: str, prefix: str, sizes: np.ndarray, offsets: np.ndarray) -> int:
    """Check that documents have non-negative sizes and follow each other from offset 0; the token count.

    Raises:
        ValueError: naming the file, the first bad document and the fix.
    """
    if sizes.size:
        bad = np.flatnonzero(sizes < 0)
        if not bad.size:
            starts = np.concatenate(([0], np.cumsum(sizes[:-1], dtype=np.int64)))
            bad = np.flatnonzero(offsets != starts)
        if bad.size:
            raise ValueError(
                f"{idx_path!r} has inconsistent document sizes/offsets (first at document {bad[0]}: size "
                f"{sizes[bad[0]]}, offset {offsets[bad[0]]}); {_fix(prefix)}"
            )
    return int(sizes.sum())


def check_bin_size(bin_path: str, idx_path: str, prefix: str, num_tokens: int, dtype: np.dtype) -> None:
    """Check that ``bin_path`` holds exactly the ``num_tokens`` tokens of ``dtype`` its index lists.

    Raises:
        ValueError: naming both files, the two sizes and the fix.
    """
    bin_len = os.path.getsize(bin_path)
    if bin_len != num_tokens * dtype.itemsize:
        raise ValueError(
            f"{bin_path!r} is truncated or corrupt: {bin_len} bytes, but {idx_path!r} lists "
            f"{num_tokens} tokens x {dtype.itemsize} bytes = {num_tokens * dtype.itemsize} bytes; "
            f"{_fix(prefix)}"
        )


def _open_checked(prefix: str) -> tuple[IndexHeader, np.ndarray, np.ndarray, int]:
    """Header, sizes, offsets and token count of ``PREFIX.idx``, with every check made against ``PREFIX.bin``.

    Raises:
        ValueError: a bad or inconsistent file (see :func:`read_index_header`, :func:`check_document_table`,
            :func:`check_bin_size`).
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    header = read_index_header(idx_path, prefix)
    sizes, offsets = _map_index(idx_path, header.num_docs)
    num_tokens = check_document_table(idx_path, prefix, sizes, offsets)
    check_bin_size(bin_path, idx_path, prefix, num_tokens, header.dtype)
    return header, sizes, offsets, num_tokens


def check_dataset_files(key: str, prefix: str) -> None:
    """Pre-flight check of the dataset ``PREFIX.bin``/``PREFIX.idx`` named by config key ``key``: the same checks
    as opening it (header, index size, document table, ``.bin`` size), without mapping the tokens.

    Raises:
        ConfigError: one line ``KEY='PREFIX': <file>: <expected vs found>; <fix>``, for a file in another format
            (Megatron-LM's included), truncated, corrupt, or unreadable.
    """
    from ..config.loader import ConfigError

    path = os.path.expanduser(prefix)
    try:
        _open_checked(path)
    except ValueError as e:
        raise ConfigError(f"{key}={prefix!r}: {e}") from None
    except OSError as e:
        raise ConfigError(
            f"{key}={prefix!r}: cannot read {e.filename!r} ({e.strerror or e}); fix its permissions or {_fix(prefix)}"
        ) from None


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin``/``PREFIX.idx``.

    Attributes:
        sizes: int64 array [num_docs], tokens per document.
        offsets: int64 array [num_docs], start of each document in ``tokens``.
        tokens: 1-D array of all token ids (the documents concatenated), dtype uint16/int32.
        vocab_size: vocabulary size recorded by the builder.
        num_tokens: total number of tokens.

    Raises (at open):
        FileNotFoundError: ``.bin`` or ``.idx`` missing.
        ValueError: another format (a Megatron-LM index is named as such), bad magic/version/dtype, or a
            truncated/inconsistent file; the message names the file, the expected and found values and the fix.
    """

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(
                    f"Indexed dataset file missing: {p!r}. Build it with "
                    f"`python tools/preprocess_data.py ... --output-prefix {self.prefix}`."
                )
        header, self.sizes, self.offsets, self.num_tokens = _open_checked(self.prefix)
        self.dtype = header.dtype
        self.vocab_size = header.vocab_size
        self.tokens = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens else np.empty(0, dtype=self.dtype)
        )

    def __len__(self) -> int:
        """Number of documents."""
        return int(self.sizes.size)

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (1-D, dtype uint16/int32, a read-only view)."""
        return self.get(i)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """``length`` tokens of document ``doc`` starting at token ``offset`` (default: to the end).

        Raises IndexError for a bad ``doc`` and ValueError for a span outside the document.
        """
        n = len(self)
        if not -n <= doc < n:
            raise IndexError(f"document {doc} out of range for {n} documents in {self.prefix!r}.")
        doc = doc % n
        size = int(self.sizes[doc])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"span offset={offset} length={length} outside document {doc} of {size} tokens.")
        start = int(self.offsets[doc]) + offset
        return self.tokens[start : start + length]

    def max_token_id(self) -> int:
        """Largest token id in the data (-1 if empty); scans the ``.bin`` in chunks."""
        chunk = 1 << 24
        return max((int(self.tokens[i : i + chunk].max()) for i in range(0, self.num_tokens, chunk)), default=-1)

    def __getstate__(self):  # pickle by path, never the mapped data
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, docs={len(self)}, tokens={self.num_tokens}, "
            f"vocab_size={self.vocab_size}, dtype={self.dtype.name})"
        )
