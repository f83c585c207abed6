#!/usr/bin/env python
"""Rewrite megatron-geo's earlier MGEOIDX ``PREFIX.idx`` files as Megatron-Core's MMIDIDX index, in place.

The ``.bin`` is left untouched (both formats describe the same token file); the new index keeps the dtype
(uint16 or int32) and has one sequence per document. An index that already is MMIDIDX is reported and left
alone. Every PREFIX is checked first (the checks of opening the dataset): a missing, truncated or corrupt one is
one ``error:`` line and exit code 2, and then nothing is rewritten. Each index is replaced atomically (temporary
file, fsync, rename). MMIDIDX records no vocabulary size: the one the old index recorded is printed, not kept.

Example:
  python tools/convert_index.py data/train data/valid
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.data.indexed_dataset import check_convertible, convert_to_mmidx  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", nargs="+", metavar="PREFIX", help="dataset path without .bin/.idx")
    args = ap.parse_args(argv)
    headers = {}
    for prefix in args.prefix:
        try:
            headers[prefix] = check_convertible(prefix)
        except (OSError, ValueError) as err:
            print(f"convert_index.py: error: {err}", file=sys.stderr)
            return 2
    for prefix, header in headers.items():
        if header.index_format == "MMIDIDX":
            print(f"{prefix}.idx is already MMIDIDX: left as it is")
            continue
        try:
            convert_to_mmidx(prefix)
        except (OSError, ValueError) as err:
            print(f"convert_index.py: error: {err}", file=sys.stderr)
            return 2
        print(
            f"{prefix}.idx: MGEOIDX -> MMIDIDX ({header.num_docs} documents, {header.dtype.name} tokens; "
            f"the recorded vocab_size={header.vocab_size} is not kept: MMIDIDX has no field for it)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
