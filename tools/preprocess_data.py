#!/usr/bin/env python
"""Tokenize documents into an indexed dataset (PREFIX.bin + PREFIX.idx).

Inputs (one kind per run):
  --input a.txt b.txt          one document per file
  --input x.jsonl y.json       one document per record, text in --text-key
  --input x.parquet            one document per row, text in --text-key
  --hf-dataset NAME            a Hugging Face dataset (--hf-config, --hf-split, --text-key)

Example:
  python tools/preprocess_data.py --input data/*.jsonl --tokenizer-model tok.model \\
      --output-prefix data/my_corpus
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.data.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from megatron_geo.data.tokenizer import Tokenizer, strip_bom  # noqa: E402

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


def load_documents(files: list[str] | None, hf_dataset: str | None, hf_config: str | None,
                   hf_split: str, text_key: str, streaming: bool = False):
    """Iterable of rows (dicts) and the text column name. Loads through `datasets.load_dataset`."""
    import datasets

    if files:
        builder = local_builder(files)
        kwargs = {"sample_by": "document", "keep_linebreaks": True} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=list(files), split="train", **kwargs)
        if builder == "text":
            text_key = "text"
    else:
        ds = datasets.load_dataset(hf_dataset, hf_config, split=hf_split, streaming=streaming)
    columns = ds.column_names
    if columns is not None and text_key not in columns:
        raise ValueError(f"text key {text_key!r} not found; available columns: {columns}. Use --text-key.")
    return ds, text_key


def _batches(rows, text_key: str, size: int):
    batch = []
    for row in rows:
        if text_key not in row:
            raise ValueError(f"text key {text_key!r} not found in a row with keys {sorted(row)}; use --text-key.")
        text = row[text_key]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"column {text_key!r} holds {type(text).__name__}, expected str.")
        batch.append(strip_bom(text) if text else text)  # a UTF-8 byte-order mark is not part of the text
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE", help=".txt, .json/.jsonl or .parquet files")
    src.add_argument("--hf-dataset", metavar="NAME", help="Hugging Face dataset name or path")
    ap.add_argument("--hf-config", default=None, help="dataset configuration name")
    ap.add_argument("--hf-split", default="train")
    ap.add_argument("--streaming", action="store_true", help="stream the HF dataset instead of downloading it")
    ap.add_argument("--text-key", default="text", help="column holding the document text (json/parquet/HF)")
    ap.add_argument("--tokenizer-model", required=True, help="SentencePiece .model file")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                    help="append the end-of-document id to every document (default: on)")
    ap.add_argument("--batch-size", type=int, default=256, help="documents tokenized per call")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    try:
        tok = Tokenizer(args.tokenizer_model)
        ds, text_key = load_documents(args.input, args.hf_dataset, args.hf_config, args.hf_split,
                                      args.text_key, args.streaming)
        total = len(ds) if hasattr(ds, "__len__") else None
        t0, n_docs, n_tok, skipped = time.time(), 0, 0, 0
        with IndexedDatasetBuilder(args.output_prefix, tok.vocab_size) as builder, \
                tqdm(total=total, desc="tokenizing", unit="doc") as bar:
            for batch in _batches(ds, text_key, max(1, args.batch_size)):
                texts = [t for t in batch if t]
                skipped += len(batch) - len(texts)
                for ids in tok.encode_batch(texts):
                    if args.append_eod:
                        ids.append(tok.eod_id)
                    builder.add_document(ids)
                    n_tok += len(ids)
                n_docs += len(texts)
                bar.update(len(batch))
    except (FileNotFoundError, ValueError) as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx: {n_docs} documents, {n_tok} tokens"
          f"{f', skipped {skipped} empty' if skipped else ''} in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
