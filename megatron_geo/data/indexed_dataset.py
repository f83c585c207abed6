"""Indexed token dataset on disk: ``PREFIX.bin`` + ``PREFIX.idx``.

``PREFIX.bin``: the token ids of all sequences, concatenated in order, little-endian, in the dtype the index
names.

``PREFIX.idx`` as written (Megatron-Core's ``MMIDIDX`` layout, version 1, the one of
``megatron/core/datasets/indexed_dataset.py`` and of Megatron-LM's ``tools/preprocess_data.py``), little-endian::

    magic              9 bytes  b"MMIDIDX\\x00\\x00"
    version            uint64   1
    dtype code         uint8    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence_count     uint64   S
    document_count     uint64   D = documents + 1 (the length of document_indices)
    sequence_lengths   int32[S]   tokens per sequence
    sequence_pointers  int64[S]   byte offset of each sequence in .bin (0, then cumulative length x itemsize)
    document_indices   int64[D]   0, then after each document the number of sequences written so far
    sequence_modes     int8[S]    only in multimodal files (read as present or absent from the file size)

A document holds one or more sequences (Megatron's ``--split-sentences`` writes one per sentence); this package's
writer makes one sequence per document unless given several lengths. A multimodal file gives every sequence a
mode, an int8 whose meaning is the data's own (Megatron-Core's multimodal datasets: 0 text, 1 image, ...); the
writer adds the ``sequence_modes`` array with ``IndexedDatasetBuilder(..., multimodal=True)``, as Megatron-Core's
``IndexedDatasetBuilder(multimodal=True)`` does. A multimodal file of no sequences has no mode bytes: it is the
same file as a plain one and reads back with no modes.

Only MMIDIDX is read. The index of earlier megatron-geo releases (``MGEOIDX``, recognised by its 8-byte magic
``b"MGEOIDX\\0"``) is refused with the command that converts it: ``python tools/convert_index.py PREFIX``
rewrites it as MMIDIDX in place, once (the ``.bin`` is the same for both and stays as it is).

Opening a dataset (and :func:`check_dataset_files`, the start-up check) validates all of the index against itself
and the ``.bin`` size, without reading the tokens: magic, version, dtype code, the ``.idx`` size its counts imply,
the sequence table, and the ``.bin`` size.
"""

from __future__ import annotations

import os
import struct
from array import array
from typing import IO, NamedTuple

import numpy as np

# ------------------------------------------------------------------ the layout

MMIDIDX_MAGIC = b"MMIDIDX\x00\x00"
MMIDIDX_VERSION = 1
_MM_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence_count, document_count: 34 bytes
# Megatron-Core's DType codes (megatron/core/datasets/indexed_dataset.py), all stored little-endian.
MMIDIDX_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
MEGATRON_LM_MAGIC = MMIDIDX_MAGIC  # the name earlier releases used

MGEOIDX_MAGIC = b"MGEOIDX\0"  # the index of earlier megatron-geo releases: refused, names tools/convert_index.py

_INT32_MAX = 2**31 - 1
_CHUNK = 1 << 22  # entries per step when validating large index arrays
_ALL_CODES = ", ".join(f"{c} ({d.name})" for c, d in MMIDIDX_DTYPES.items())


def _largest_exact_id(dtype: np.dtype) -> int:
    """Largest token id ``dtype`` holds exactly: the integer maximum, or 2**mantissa bits for floats."""
    if dtype.kind == "f":
        return 2 ** (np.finfo(dtype).nmant + 1)
    return int(np.iinfo(dtype).max)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Storage dtype the writer picks for ids in ``[0, vocab_size)``: little-endian uint16 when
    ``vocab_size < 65500``, else int32 (Megatron-Core's ``DType.optimal_dtype`` rule, so our files match the ones
    Megatron-LM's ``tools/preprocess_data.py`` writes for the same vocabulary).

    Raises:
        ValueError: ``vocab_size`` is not positive, or above 2**31 (ids would not fit int32).
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be positive.")
    if vocab_size > 2**31:
        raise ValueError(f"vocab_size={vocab_size} does not fit int32 token ids.")
    return MMIDIDX_DTYPES[8] if vocab_size < 65500 else MMIDIDX_DTYPES[4]


def mmidx_dtype_code(dtype) -> int:
    """MMIDIDX dtype code (1..8) of a numpy dtype, matched by kind and size (byte order ignored).

    Raises:
        ValueError: the dtype is none of the 8 (names them).
    """
    dt = np.dtype(dtype)
    for code, d in MMIDIDX_DTYPES.items():
        if (d.kind, d.itemsize) == (dt.kind, dt.itemsize):
            return code
    raise ValueError(f"dtype {dt} has no MMIDIDX dtype code; use one of {_ALL_CODES}")


def _checked_modes(modes, count: int, what: str) -> np.ndarray:
    """``modes`` as int8 [count].

    Raises:
        ValueError: not a 1-D sequence of ``count`` integers, or a value outside the int8 range [-128, 127].
    """
    arr = np.asarray(modes)
    if arr.ndim != 1 or arr.size != count:
        got = arr.size if arr.ndim == 1 else f"shape {arr.shape} of"
        raise ValueError(f"{what}: {got} modes for {count} sequences; give one mode per sequence")
    if not arr.size:
        return np.empty(0, np.int8)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: modes must be integers, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < -128) | (arr > 127))
    if bad.size:
        raise ValueError(f"{what}: mode {int(arr[bad[0]])} outside the int8 range [-128, 127] of sequence_modes")
    return arr.astype(np.int8)


def write_mmidx_index(
    f,
    dtype: np.dtype,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: np.ndarray | None = None,
) -> None:
    """Write a whole MMIDIDX version-1 index to the binary file object ``f`` (layout in the module docstring).

    Args:
        dtype: storage dtype of the ``.bin`` (one of :data:`MMIDIDX_DTYPES`).
        sequence_lengths: int [S], tokens per sequence (each in ``[0, 2**31)``).
        document_indices: int [D], 0 first, non-decreasing, ``S`` last.
        sequence_modes: None (a plain index), or int [S] in [-128, 127]: the mode of each sequence, written as
            the trailing int8 ``sequence_modes`` array of a multimodal index.

    ``sequence_pointers`` are derived: byte offsets from 0, cumulative ``length * itemsize``. Written in chunks,
    so memory stays bounded for large indexes.

    Raises:
        ValueError: ``sequence_modes`` not of S integers in the int8 range.
    """
    code = mmidx_dtype_code(dtype)
    itemsize = MMIDIDX_DTYPES[code].itemsize
    lengths = np.asarray(sequence_lengths)
    docs = np.asarray(document_indices)
    modes = None if sequence_modes is None else _checked_modes(sequence_modes, lengths.size, "write_mmidx_index")
    f.write(_MM_HEADER.pack(MMIDIDX_MAGIC, MMIDIDX_VERSION, code, lengths.size, docs.size))
    for start in range(0, lengths.size, _CHUNK):
        f.write(lengths[start : start + _CHUNK].astype("<i4").tobytes())
    done = 0
    for start in range(0, lengths.size, _CHUNK):
        chunk = lengths[start : start + _CHUNK].astype(np.int64)
        ends = np.cumsum(chunk) + done
        f.write(((ends - chunk) * itemsize).astype("<i8").tobytes())
        done = int(ends[-1])
    for start in range(0, docs.size, _CHUNK):
        f.write(docs[start : start + _CHUNK].astype("<i8").tobytes())
    if modes is not None:
        f.write(modes.tobytes())


# ------------------------------------------------------------------ writer


class IndexedDatasetBuilder:
    """Write sequences and documents to ``PREFIX.bin``/``PREFIX.idx`` in Megatron-Core's MMIDIDX layout.

    Args:
        prefix: output path without extension.
        vocab_size: tokenizer vocabulary; every id must be in ``[0, vocab_size)``.
        dtype: storage dtype of the tokens; None picks :func:`dtype_for_vocab` (uint16 below 65500 ids, else
            int32). An explicit one must be among the 8 MMIDIDX dtypes and hold every id of the vocabulary
            exactly (floats: up to 2**24 for float32, 2**53 for float64).
        multimodal: write the ``sequence_modes`` array (one int8 mode per sequence; Megatron-Core's
            ``IndexedDatasetBuilder(multimodal=True)``). The ``mode`` / ``modes`` arguments below give the modes
            (default 0); without it they must be 0, as there is nowhere to keep another value.

    Two ways to add data: ``add_document(ids)`` (one document of one sequence) or ``add_document(ids,
    lengths=[...], modes=[...])`` (one document of several sequences); or Megatron-style ``add_item(ids, mode)``
    per sequence and ``end_document()`` after each document (``finalize`` ends a document left open).

    Data goes to temporary files that ``finalize()`` renames into place (``os.replace``), so a crash never
    leaves a half-written dataset under the final names. Usable as a context manager: on exception the
    temporary files are removed, otherwise it finalizes.

    Raises:
        ValueError: bad ``vocab_size`` or ``dtype`` (names the value and the choices).
    """

    def __init__(self, prefix: str, vocab_size: int, dtype=None, multimodal: bool = False):
        self.prefix = str(prefix)
        self.vocab_size = int(vocab_size)
        self.multimodal = bool(multimodal)
        if dtype is None:
            self.dtype = dtype_for_vocab(self.vocab_size)
        else:
            if self.vocab_size <= 0:
                raise ValueError(f"vocab_size={self.vocab_size} must be positive.")
            self.dtype = MMIDIDX_DTYPES[mmidx_dtype_code(dtype)]
            top = _largest_exact_id(self.dtype)
            if self.vocab_size - 1 > top:
                raise ValueError(
                    f"dtype {self.dtype.name} holds ids up to {top} exactly, but vocab_size={self.vocab_size} "
                    f"needs {self.vocab_size - 1}; pass a wider dtype or dtype=None"
                )
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin = self.prefix + ".bin" + tag
        self._tmp_idx = self.prefix + ".idx" + tag
        self._bin: IO[bytes] | None = open(self._tmp_bin, "wb")  # noqa: SIM115 -- written by add_* until finalize closes it
        self._lengths = array("q")  # tokens per sequence
        self._doc_indices = array("q", [0])  # sequences written at each document end
        self._modes = array("b")  # mode of each sequence (multimodal only)

    def _ids(self, ids, what: str) -> np.ndarray:
        if self._bin is None:
            raise ValueError(f"IndexedDatasetBuilder({self.prefix!r}) is already finalized.")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"{what} expects a 1-D sequence of ids, got shape {arr.shape}.")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{what} expects integer ids, got dtype {arr.dtype}.")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"token id {lo if lo < 0 else hi} outside [0, {self.vocab_size}); "
                    f"the builder's vocab_size must match the tokenizer."
                )
        return arr

    def _modes_of(self, modes, count: int, what: str) -> np.ndarray:
        """The int8 modes of ``count`` new sequences (None: all 0), checked for this builder."""
        out = np.zeros(count, np.int8) if modes is None else _checked_modes(modes, count, what)
        if not self.multimodal and out.any():
            raise ValueError(
                f"{what}: mode {int(out[np.flatnonzero(out)[0]])} given to a builder without sequence modes; "
                f"create it with IndexedDatasetBuilder({self.prefix!r}, ..., multimodal=True) to write them"
            )
        return out

    def _write(self, arr: np.ndarray, lengths: list[int], modes: np.ndarray) -> None:
        assert self._bin is not None  # _ids refused a finalized builder
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.extend(lengths)
        if self.multimodal:
            self._modes.extend(modes.tolist())

    def add_item(self, ids, mode: int = 0) -> None:
        """Append one sequence (1-D int ids, list or array) to the current document.

        Args:
            ids: int token ids [N].
            mode: the sequence's mode (an int in [-128, 127]; kept by a ``multimodal`` builder, else must be 0).

        Raises:
            ValueError: an id outside ``[0, vocab_size)``, non-integer or not 1-D input, more than 2**31 - 1
                tokens (the index stores int32 lengths), a bad ``mode``, or the builder is finalized.
        """
        arr = self._ids(ids, "add_item")
        if arr.size > _INT32_MAX:
            raise ValueError(f"a sequence of {arr.size} tokens exceeds the index's int32 length; split it.")
        self._write(arr, [int(arr.size)], self._modes_of([mode], 1, "add_item"))

    def end_document(self) -> None:
        """End the current document: the sequences added since the previous end form one document."""
        if self._bin is None:
            raise ValueError(f"IndexedDatasetBuilder({self.prefix!r}) is already finalized.")
        self._doc_indices.append(len(self._lengths))

    def add_document(self, ids, lengths=None, modes=None) -> None:
        """Append one document: 1-D int ids, one sequence (``lengths=None``) or several of the given lengths.

        Args:
            ids: int token ids [N] of the whole document.
            lengths: None, or ints >= 0 summing to N: the sequences' lengths in order.
            modes: None (every sequence mode 0), or one int in [-128, 127] per sequence (kept by a
                ``multimodal`` builder, else all must be 0).

        Raises:
            ValueError: an id outside ``[0, vocab_size)``, non-integer or not 1-D input, lengths that are
                negative, above 2**31 - 1 or do not sum to N, not one mode per sequence or a mode outside int8
                (or non-zero without ``multimodal``), sequences added with ``add_item`` and not yet ended with
                ``end_document``, or the builder is finalized.
        """
        arr = self._ids(ids, "add_document")
        if len(self._lengths) != self._doc_indices[-1]:
            raise ValueError(
                f"add_document after add_item without end_document in {self.prefix!r}: call end_document() "
                f"first (or add the document's sequences with add_item)."
            )
        if lengths is None:
            if arr.size > _INT32_MAX:
                raise ValueError(f"a sequence of {arr.size} tokens exceeds the index's int32 length; split it.")
            lens = [int(arr.size)]
        else:
            lens_arr = np.asarray(lengths)
            if lens_arr.ndim != 1 or (lens_arr.size and not np.issubdtype(lens_arr.dtype, np.integer)):
                raise ValueError(f"lengths must be a 1-D sequence of ints, got {lengths!r:.80}.")
            lens = [int(x) for x in lens_arr]
            bad = [x for x in lens if not 0 <= x <= _INT32_MAX]
            if bad:
                raise ValueError(f"sequence length {bad[0]} outside [0, 2**31 - 1].")
            if sum(lens) != arr.size:
                raise ValueError(f"lengths sum to {sum(lens)}, but the document has {arr.size} ids.")
        self._write(arr, lens, self._modes_of(modes, len(lens), "add_document"))
        self.end_document()

    def finalize(self) -> None:
        """Write the index and atomically move both files to their final names (ends an open document)."""
        if self._bin is None:
            return
        if len(self._lengths) != self._doc_indices[-1]:
            self.end_document()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._bin = None
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if self._lengths else np.empty(0, np.int64)
        docs = np.frombuffer(self._doc_indices, dtype=np.int64)
        modes = None
        if self.multimodal:
            modes = np.frombuffer(self._modes, dtype=np.int8) if self._modes else np.empty(0, np.int8)
        with open(self._tmp_idx, "wb") as f:
            write_mmidx_index(f, self.dtype, lengths, docs, modes)
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


# ------------------------------------------------------------------ header and table checks


class IndexHeader(NamedTuple):
    """The validated header of an MMIDIDX ``PREFIX.idx``.

    Fields: ``dtype`` (storage dtype of the ``.bin``), ``num_docs`` (documents), ``num_sequences`` and
    ``has_modes`` (the file has the trailing int8 sequence_modes array).
    """

    dtype: np.dtype
    num_docs: int
    num_sequences: int
    has_modes: bool = False


def _fix(prefix: str) -> str:
    return f"re-run tools/preprocess_data.py --output-prefix {prefix} to rebuild it"


def _read_mmidx_header(idx_path: str, prefix: str, head: bytes, idx_len: int) -> IndexHeader:
    if len(head) < _MM_HEADER.size:
        raise ValueError(
            f"{idx_path!r} is truncated: {idx_len} bytes, shorter than the {_MM_HEADER.size}-byte MMIDIDX header; "
            f"{_fix(prefix)}"
        )
    _, version, code, seq, doc = _MM_HEADER.unpack(head[: _MM_HEADER.size])
    if version != MMIDIDX_VERSION:
        raise ValueError(f"{idx_path!r} has MMIDIDX version {version}, expected {MMIDIDX_VERSION}; {_fix(prefix)}")
    if code not in MMIDIDX_DTYPES:
        raise ValueError(
            f"{idx_path!r} has unknown MMIDIDX dtype code {code}, expected one of {_ALL_CODES}; {_fix(prefix)}"
        )
    if doc < 1:
        raise ValueError(
            f"{idx_path!r} has document_count {doc}, expected >= 1 (document_indices starts with 0; "
            f"corrupt header); {_fix(prefix)}"
        )
    base = _MM_HEADER.size + 12 * seq + 8 * doc
    if idx_len not in (base, base + seq):
        raise ValueError(
            f"{idx_path!r} is truncated or corrupt: {idx_len} bytes, expected {base} ({_MM_HEADER.size}-byte "
            f"header + 12 bytes x {seq} sequences + 8 bytes x {doc} document_indices)"
            f"{f' or {base + seq} with sequence_modes' if seq else ''} for its sequence_count {seq} and "
            f"document_count {doc}; {_fix(prefix)}"
        )
    return IndexHeader(MMIDIDX_DTYPES[code], int(doc) - 1, int(seq), idx_len > base)


def read_index_header(idx_path: str, prefix: str) -> IndexHeader:
    """Read and check the MMIDIDX header of ``idx_path`` against the file's size.

    Checks the magic, the version, the dtype code (one of the 8 Megatron-Core codes) and that the file is
    exactly as long as its counts imply (34-byte header + 12 bytes per sequence + 8 per document index, + 1 per
    sequence with sequence modes). ``prefix`` only goes into the fix of the message.

    Raises:
        ValueError: one line naming the file, the field, what was expected and what was found, and the fix
            (a short file's message says "truncated"). An MGEOIDX index of earlier releases is refused with
            the command that converts it, ``python tools/convert_index.py PREFIX``.
        OSError: the file cannot be read.
    """
    idx_len = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_MM_HEADER.size)
    if head.startswith(MMIDIDX_MAGIC):
        return _read_mmidx_header(idx_path, prefix, head, idx_len)
    if head.startswith(MGEOIDX_MAGIC):
        raise ValueError(
            f"{idx_path!r} is an MGEOIDX index, the format of earlier megatron-geo releases, which is no longer "
            f"read; convert it to MMIDIDX in place once with `python tools/convert_index.py {prefix}`"
        )
    if len(head) < len(MMIDIDX_MAGIC) and MMIDIDX_MAGIC.startswith(head):
        raise ValueError(
            f"{idx_path!r} is truncated: {idx_len} bytes, shorter than the {_MM_HEADER.size}-byte MMIDIDX header; "
            f"{_fix(prefix)}"
        )
    magic = head[: len(MMIDIDX_MAGIC)]
    raise ValueError(
        f"{idx_path!r} is not an indexed dataset index (bad magic {magic!r}, expected {MMIDIDX_MAGIC!r} of "
        f"Megatron-Core's MMIDIDX); {_fix(prefix)}"
    )


def check_sequence_table(
    idx_path: str,
    prefix: str,
    sequence_lengths: np.ndarray,
    sequence_pointers: np.ndarray,
    document_indices: np.ndarray,
    itemsize: int,
) -> int:
    """MMIDIDX table check (vectorised, in chunks of a memory-mapped index); returns the total token count.

    Args:
        sequence_lengths: int32 [S], must be >= 0.
        sequence_pointers: int64 [S], must equal the byte offsets ``itemsize * (sum of earlier lengths)``.
        document_indices: int64 [D >= 1], must start at 0, never decrease and end at S.
        itemsize: bytes per token of the ``.bin``.

    Raises:
        ValueError: naming the file, the array, the first bad entry (found vs expected) and the fix.
    """
    n = sequence_lengths.size
    done = 0
    for start in range(0, n, _CHUNK):
        ln = np.asarray(sequence_lengths[start : start + _CHUNK], dtype=np.int64)
        bad = np.flatnonzero(ln < 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{idx_path!r} has sequence_lengths[{start + i}] = {ln[i]}, expected >= 0 (corrupt index); "
                f"{_fix(prefix)}"
            )
        ends = np.cumsum(ln) + done
        want = (ends - ln) * itemsize
        ptr = np.asarray(sequence_pointers[start : start + _CHUNK], dtype=np.int64)
        bad = np.flatnonzero(ptr != want)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{idx_path!r} has inconsistent sequence_pointers (first at sequence {start + i}: pointer "
                f"{ptr[i]}, expected byte offset {want[i]} = {itemsize} bytes x the tokens before it); "
                f"{_fix(prefix)}"
            )
        done = int(ends[-1])
    first = int(document_indices[0])
    if first != 0:
        raise ValueError(f"{idx_path!r} has document_indices[0] = {first}, expected 0; {_fix(prefix)}")
    prev = 0
    for start in range(0, document_indices.size, _CHUNK):
        d = np.asarray(document_indices[start : start + _CHUNK], dtype=np.int64)
        bad = np.flatnonzero(np.diff(d, prepend=prev) < 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{idx_path!r} has decreasing document_indices (first at entry {start + i}: {d[i]} after "
                f"{d[i - 1] if i else prev}, expected non-decreasing sequence counts); {_fix(prefix)}"
            )
        prev = int(d[-1])
    if prev != n:
        raise ValueError(
            f"{idx_path!r} has document_indices ending at {prev}, expected the sequence_count {n}; {_fix(prefix)}"
        )
    return done


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


class _Tables(NamedTuple):
    header: IndexHeader
    lengths: np.ndarray  # int32 [S], tokens per sequence (as stored)
    pointers: np.ndarray  # int64 [S], byte offsets
    document_indices: np.ndarray  # int64 [D]
    modes: np.ndarray | None  # int8 [S] of a multimodal file
    num_tokens: int


def _view(raw: np.ndarray | None, dtype: str, count: int, offset: int) -> np.ndarray:
    if raw is None or count == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(raw, dtype=dtype, count=count, offset=offset)


def _open_checked(prefix: str) -> _Tables:
    """The header and memory-mapped tables of ``PREFIX.idx``, with every check made against ``PREFIX.bin``.

    Raises:
        ValueError: a bad or inconsistent file, or an MGEOIDX index (see :func:`read_index_header`,
            :func:`check_sequence_table`, :func:`check_bin_size`).
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    h = read_index_header(idx_path, prefix)
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r") if os.path.getsize(idx_path) else None
    s, pos = h.num_sequences, _MM_HEADER.size
    lengths = _view(raw, "<i4", s, pos)
    pointers = _view(raw, "<i8", s, pos + 4 * s)
    docs = _view(raw, "<i8", h.num_docs + 1, pos + 12 * s)
    modes = _view(raw, "i1", s, pos + 12 * s + 8 * (h.num_docs + 1)) if h.has_modes else None
    num_tokens = check_sequence_table(idx_path, prefix, lengths, pointers, docs, h.dtype.itemsize)
    check_bin_size(bin_path, idx_path, prefix, num_tokens, h.dtype)
    return _Tables(h, lengths, pointers, docs, modes, num_tokens)


def check_dataset_files(key: str, prefix: str) -> None:
    """Pre-flight check of the dataset ``PREFIX.bin``/``PREFIX.idx`` named by config key ``key``: the same checks
    as opening it (header, index size, sequence table, ``.bin`` size), without mapping the tokens.

    Raises:
        ConfigError: one line ``KEY='PREFIX': <file>: <expected vs found>; <fix>``, for a file that is not
            MMIDIDX, truncated, corrupt, or unreadable; an MGEOIDX index is refused with the command that
            converts it (``python tools/convert_index.py PREFIX``).
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


# ------------------------------------------------------------------ reader


class IndexedDataset:
    """Read-only, memory-mapped view of an MMIDIDX ``PREFIX.bin``/``PREFIX.idx`` (layout in the module docstring).

    A list of sequences grouped into documents by ``document_indices``.

    Attributes:
        prefix: the path without extension.
        sizes: int64 [num_sequences], tokens per sequence.
        offsets: int64 [num_sequences], start of each sequence in ``tokens``, in tokens (the index's byte
            pointers divided by the itemsize).
        document_indices: int64 [num_documents + 1]; document ``d`` is sequences
            ``document_indices[d]:document_indices[d + 1]``.
        sequence_modes: int8 [num_sequences] of a multimodal file, else None.
        tokens: 1-D memory map of the whole ``.bin`` in the index's dtype. Float dtypes (codes 6, 7) stay the raw
            float map: ids are its values, convert them (``astype(np.int64)``) before using them as indices.
        dtype: numpy dtype of ``tokens``.
        num_tokens, num_documents: totals.

    The index records no vocabulary: compare :meth:`max_token_id` with the tokenizer's.

    Memory: the index is mapped and validated in chunks, but ``sizes`` and ``offsets`` are int64 copies
    (16 bytes per sequence in RAM). The ``.bin`` is never read at open.

    Raises (at open):
        FileNotFoundError: ``.bin`` or ``.idx`` missing.
        ValueError: not MMIDIDX, bad magic/version/dtype code, or a truncated/inconsistent file; the message
            names the file, the field, the expected and found values and the fix. An MGEOIDX index of earlier
            releases is refused with the command that converts it, ``python tools/convert_index.py PREFIX``.
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
        t = _open_checked(self.prefix)
        self.dtype = t.header.dtype
        self.num_tokens = t.num_tokens
        self.sequence_modes = t.modes
        self.sizes = np.asarray(t.lengths, dtype=np.int64)
        self.offsets = np.asarray(t.pointers, dtype=np.int64) // self.dtype.itemsize
        self.document_indices: np.ndarray = t.document_indices
        self.num_documents = int(self.document_indices.size) - 1
        self.tokens = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens else np.empty(0, dtype=self.dtype)
        )

    def __len__(self) -> int:
        """Number of sequences."""
        return int(self.sizes.size)

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of sequence ``i`` (1-D, the index's dtype, a read-only view)."""
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """``length`` tokens of sequence ``i`` starting at token ``offset`` (default: to the end).

        Raises IndexError for a bad ``i`` and ValueError for a span outside the sequence.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix!r}.")
        i = i % n
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"span offset={offset} length={length} outside sequence {i} of {size} tokens.")
        start = int(self.offsets[i]) + offset
        return self.tokens[start : start + length]

    def max_token_id(self, max_tokens: int | None = None) -> int:
        """Largest token id among the first ``max_tokens`` tokens (None: all), -1 if none; reads the ``.bin`` in
        chunks of 16M tokens. Float dtypes: the largest value, truncated to int."""
        end = self.num_tokens if max_tokens is None else min(self.num_tokens, max(0, int(max_tokens)))
        chunk = 1 << 24
        return max((int(self.tokens[i : min(i + chunk, end)].max()) for i in range(0, end, chunk)), default=-1)

    def __getstate__(self):  # pickle by path, never the mapped data
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype.name})"
        )
