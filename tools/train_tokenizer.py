#!/usr/bin/env python
"""Train a SentencePiece tokenizer (writes PREFIX.model and PREFIX.vocab).

Examples:
  python tools/train_tokenizer.py --input a.txt b.txt --vocab-size 32000 --model-prefix out/tok
  python tools/train_tokenizer.py --hf-dataset NAME --hf-split train --text-key text \\
      --vocab-size 32000 --model-prefix out/tok
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.data.tokenizer import MODEL_TYPES, Tokenizer, train_tokenizer  # noqa: E402


def dump_hf_dataset(
    name: str, config: str | None, split: str, text_key: str, max_docs: int | None, out_path: str
) -> int:
    """Write the ``text_key`` column of a Hugging Face dataset to a text file; returns the doc count."""
    import datasets

    ds = datasets.load_dataset(name, config, split=split, streaming=True)
    n = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for row in ds:
            if text_key not in row:
                raise ValueError(
                    f"text key {text_key!r} not in dataset {name!r} (keys: {sorted(row)}); use --text-key."
                )
            text = row[text_key]
            text = text.removeprefix("\ufeff") if isinstance(text, str) else text  # no byte-order mark
            if text:
                f.write(text if text.endswith("\n") else text + "\n")
                n += 1
            if max_docs is not None and n >= max_docs:
                break
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE", help="UTF-8 text files")
    src.add_argument("--hf-dataset", metavar="NAME", help="Hugging Face dataset name or path")
    ap.add_argument("--hf-config", default=None)
    ap.add_argument("--hf-split", default="train")
    ap.add_argument("--text-key", default="text")
    ap.add_argument("--max-docs", type=int, default=None, help="use at most this many HF documents")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--model-prefix", required=True, help="output path without extension")
    ap.add_argument("--model-type", default="bpe", choices=MODEL_TYPES)
    args = ap.parse_args(argv)

    t0 = time.time()
    try:
        if args.input:
            model = train_tokenizer(args.input, args.model_prefix, args.vocab_size, args.model_type)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                text = os.path.join(tmp, "text.txt")
                n = dump_hf_dataset(args.hf_dataset, args.hf_config, args.hf_split, args.text_key, args.max_docs, text)
                if n == 0:
                    raise ValueError(f"dataset {args.hf_dataset!r} split {args.hf_split!r} has no non-empty text.")
                model = train_tokenizer([text], args.model_prefix, args.vocab_size, args.model_type)
    except (FileNotFoundError, ValueError) as err:
        print(f"train_tokenizer.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {model} (vocab {Tokenizer(model).vocab_size}) in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
