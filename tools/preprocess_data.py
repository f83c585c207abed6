#!/usr/bin/env python
"""Tokenize documents into an indexed dataset (PREFIX.bin + PREFIX.idx).

The files are Megatron-Core's indexed dataset (MMIDIDX index, one sequence per document; uint16 tokens for a
vocabulary below 65,500 ids, else int32), so Megatron-LM reads them too, and this package reads the files
Megatron-LM's own preprocessing writes.

Inputs (one kind per run):
  --input a.txt b.txt          one document per file
  --input x.jsonl y.json       one document per record (a JSON object per line, or one JSON array of
                               objects), text in --text-key
  --input x.parquet            one document per row, text in --text-key
  --hf-dataset NAME            a Hugging Face dataset (--hf-config, --hf-split, --text-key)

Every record must have --text-key with a string value (an empty string is skipped as an empty document); only
that key is read, other keys may differ between files. A record without it, a value that is not a string, a line
that is not a JSON object, or inputs without any document: one error line naming the file and row, exit code 2.

Tokenizers (--tokenizer-type, Megatron-LM's spellings or ours):
  SentencePieceTokenizer | sentencepiece   --tokenizer-model is a SentencePiece .model file (the default)
  HuggingFaceTokenizer | huggingface       --tokenizer-model is a folder transformers' AutoTokenizer loads
                                           (tokenizer.json; ids of len(tokenizer), EOS as end of document,
                                           no special tokens added to the text)

Examples:
  python tools/preprocess_data.py --input data/*.jsonl --tokenizer-model tok.model \\
      --output-prefix data/my_corpus
  python tools/preprocess_data.py --input data/*.jsonl --tokenizer-type HuggingFaceTokenizer \\
      --tokenizer-model /models/SmolLM2-135M --output-prefix data/my_corpus
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.data.hf_tokenizer import load_tokenizer, tokenizer_type_name  # noqa: E402
from megatron_geo.data.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from megatron_geo.data.tokenizer import strip_bom  # noqa: E402

_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def local_builder(files: list[str]) -> str:
    """The `datasets` builder ("text"|"json"|"parquet") for local files; all must be one kind.

    Raises FileNotFoundError for a missing file and ValueError for an unknown or mixed extension.
    """
    if not files:
        raise ValueError("no input files given.")
    kinds = set()
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"input file not found: {f!r}")
        ext = os.path.splitext(f)[1].lower()
        if ext not in _BUILDERS:
            raise ValueError(f"unknown input extension {ext!r} of {f!r}; use one of {sorted(_BUILDERS)}.")
        kinds.add(_BUILDERS[ext])
    if len(kinds) > 1:
        raise ValueError(f"inputs mix file kinds {sorted(kinds)}; preprocess each kind separately.")
    return kinds.pop()


class InputError(ValueError):
    """An input file or row that cannot be a document; the message names the file, the row and the fix."""


def _kind(value) -> str:
    """What a decoded JSON (or dataset) value is, in JSON's terms: ``null``, ``a number``, ``an array``, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "an array", dict: "an object", str: "a string"}.get(type(value), f"a {type(value).__name__}")


def document_text(row: dict, text_key: str, where: str, hint: str = "") -> str:
    """The document text of one input row: ``row[text_key]`` (``""`` for an empty document).

    ``where`` names the row in messages (``"a.jsonl line 3"``); ``hint`` is added to a missing-key message.

    Raises:
        InputError: the key is missing (names the keys the row has and ``--text-key``), or its value is not a
            string (null, a number, an array, ...).
    """
    if text_key not in row:
        raise InputError(
            f"{where}: text key {text_key!r} not found; the row has keys {sorted(row)}{hint}; pass the "
            f"key holding the text with --text-key KEY"
        )
    text = row[text_key]
    if not isinstance(text, str):
        shown = json.dumps(text, default=str, ensure_ascii=False)
        shown = "" if text is None else f" ({shown})" if len(shown) <= 40 else f" ({shown[:37]}...)"
        raise InputError(
            f"{where}: {text_key!r} holds {_kind(text)}{shown}, expected a string (the document "
            f"text); fix or remove that row, or choose another --text-key"
        )
    return strip_bom(text)  # a UTF-8 byte-order mark is not part of the text


def _decode_line(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: not UTF-8 (byte {e.start} of the line: {e.reason}); save the file as UTF-8"
        ) from None


def _json_lines(path: str):
    """``(where, row)`` for every non-blank line of a JSON-lines file; each line must be one JSON object."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path} line {number}"
            line = _decode_line(raw, where)
            if number == 1:
                line = strip_bom(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(
                    f"{where}: not valid JSON ({e.msg.removesuffix(' at')}, column {e.colno}); "
                    f"each line must be one JSON "
                    f'object such as {{"text": "..."}}'
                ) from None
            if not isinstance(row, dict):
                raise InputError(
                    f'{where}: {_kind(row)}, not an object; each line must be one JSON object such as {{"text": "..."}}'
                )
            yield where, row


def _json_array(path: str):
    """``(where, row)`` for every element of a file holding one JSON array of objects."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            records = json.load(f)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 (byte {e.start}: {e.reason}); save the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise InputError(
            f"{path}: not valid JSON ({e.msg.removesuffix(' at')}, line {e.lineno}, column {e.colno}); give one JSON "
            f"array of objects, or one object per line"
        ) from None
    for number, row in enumerate(records, 1):
        where = f"{path} record {number}"
        if not isinstance(row, dict):
            raise InputError(
                f'{where}: {_kind(row)}, not an object; the array must hold objects such as {{"text": "..."}}'
            )
        yield where, row


def json_rows(path: str):
    """``(where, row)`` for every record of a ``.json``/``.jsonl`` file: one JSON object per line (JSON lines), or
    a file whose first character is ``[``: one JSON array of objects.

    Raises:
        InputError: a line or record that is not valid UTF-8 JSON or not an object (names the file and line).
    """
    with open(path, "rb") as f:
        start = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return _json_array(path) if start.startswith(b"[") else _json_lines(path)


def text_file_rows(path: str):
    """One ``(where, {"text": content})`` row for a ``.txt`` file (one document; newlines read as ``\\n``).

    Raises:
        InputError: the file is not UTF-8.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    yield path, {"text": text}


def _load_dataset(what: str, *args, **kwargs):
    """``datasets.load_dataset(*args, **kwargs)``; its errors become one :class:`InputError` naming ``what``."""
    import datasets

    try:
        return datasets.load_dataset(*args, **kwargs)
    except (datasets.exceptions.DatasetsError, FileNotFoundError, ValueError, OSError) as e:
        cause = e.__cause__ or e
        raise InputError(
            f"{what}: cannot be read ({type(cause).__name__}: {' '.join(str(cause).split())[:300]})"
        ) from None


def _dataset_rows(ds, label: str):
    """``(where, row)`` for every row of a loaded dataset."""
    for number, row in enumerate(ds, 1):
        yield f"{label} row {number}", row


def parquet_rows(path: str):
    """``(where, row)`` for every row of one ``.parquet`` file (read alone, so files may have other columns)."""
    yield from _dataset_rows(_load_dataset(path, "parquet", data_files=[path], split="train"), path)


def hub_rows(name: str, config: str | None, split: str, streaming: bool):
    """``(where, row)`` for every row of a Hugging Face dataset split."""
    yield from _dataset_rows(
        _load_dataset(name, name, config, split=split, streaming=streaming), f"{name} ({split} split)"
    )


def iter_documents(
    files: list[str] | None,
    hf_dataset: str | None,
    hf_config: str | None,
    hf_split: str,
    text_key: str,
    streaming: bool = False,
):
    """The text (``str``, possibly empty) of every input document, in input order.

    Local files are read one by one: ``.txt`` (one document per file), ``.json``/``.jsonl`` (one per record, text
    in ``text_key``), ``.parquet`` (one per row); otherwise the Hugging Face dataset ``hf_dataset``. Only
    ``text_key`` is read: other columns may differ between files.

    Raises:
        FileNotFoundError / ValueError: see :func:`local_builder`.
        InputError: a row without ``text_key`` (naming the file, the row, its keys, and which earlier file had
            the key), a non-string text, a line that is not a JSON object, a file that is not UTF-8.
    """
    if not files:
        sources = [(hf_dataset, hub_rows(hf_dataset, hf_config, hf_split, streaming))]
    else:
        kind = local_builder(files)
        reader = {"text": text_file_rows, "json": json_rows, "parquet": parquet_rows}[kind]
        sources = [(f, reader(f)) for f in files]
        if kind == "text":
            text_key = "text"
    with_key = None  # (file, keys of its first row) of an earlier input that had text_key
    for source, rows in sources:
        hint = (
            f" (rows of {with_key[0]} have keys {with_key[1]}: the inputs have different columns)" if with_key else ""
        )
        for where, row in rows:
            text = document_text(row, text_key, where, hint)  # the hint for a file whose first row lacks the key
            hint = ""
            if with_key is None:
                with_key = (source, sorted(row))
            yield text


def _batches(texts, size: int):
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _no_documents_error(inputs: str, rows: int) -> InputError:
    """The error for inputs that hold no document (no rows at all, or only empty texts)."""
    if rows == 0:
        return InputError(f"{inputs}: no documents (the input has no rows); check the paths and the file contents")
    return InputError(
        f"{inputs}: no documents: the text of all {rows} rows is empty; check --text-key and the file contents"
    )


def _tokenizer_type(text: str) -> str:
    """argparse type of --tokenizer-type: ``sentencepiece`` or ``huggingface``."""
    try:
        return tokenizer_type_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE", help=".txt, .json/.jsonl or .parquet files")
    src.add_argument("--hf-dataset", metavar="NAME", help="Hugging Face dataset name or path")
    ap.add_argument("--hf-config", default=None, help="dataset configuration name")
    ap.add_argument("--hf-split", default="train")
    ap.add_argument("--streaming", action="store_true", help="stream the HF dataset instead of downloading it")
    ap.add_argument("--text-key", default="text", help="column holding the document text (json/parquet/HF)")
    ap.add_argument(
        "--tokenizer-type",
        type=_tokenizer_type,
        default="sentencepiece",
        metavar="TYPE",
        help="SentencePieceTokenizer (default) or HuggingFaceTokenizer (also: sentencepiece, huggingface)",
    )
    ap.add_argument(
        "--tokenizer-model",
        required=True,
        help="SentencePiece .model file, or a Hugging Face tokenizer folder (--tokenizer-type HuggingFaceTokenizer)",
    )
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the end-of-document id to every document (default: on)",
    )
    ap.add_argument("--batch-size", type=int, default=256, help="documents tokenized per call")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    inputs = " ".join(args.input) if args.input else args.hf_dataset
    try:
        tok = load_tokenizer(args.tokenizer_type, args.tokenizer_model, "--tokenizer-model")
        eod = tok.eod_id if args.append_eod else None  # a tokenizer without one fails here, before any writing
        texts = iter_documents(
            args.input, args.hf_dataset, args.hf_config, args.hf_split, args.text_key, args.streaming
        )
        t0, n_docs, n_tok, rows = time.time(), 0, 0, 0
        with (
            IndexedDatasetBuilder(args.output_prefix, tok.vocab_size) as builder,
            tqdm(desc="tokenizing", unit="doc") as bar,
        ):
            for batch in _batches(texts, max(1, args.batch_size)):
                kept = [t for t in batch if t]
                rows += len(batch)
                for ids in tok.encode_batch(kept):
                    if eod is not None:
                        ids.append(eod)
                    builder.add_document(ids)
                    n_tok += len(ids)
                n_docs += len(kept)
                bar.update(len(batch))
            if n_docs == 0:
                raise _no_documents_error(inputs, rows)
    except (OSError, ValueError) as err:  # FileNotFoundError, InputError and UnicodeDecodeError among them
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    skipped = rows - n_docs
    print(
        f"wrote {args.output_prefix}.bin/.idx: {n_docs} documents, {n_tok} tokens"
        f"{f', skipped {skipped} empty' if skipped else ''} in {time.time() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
