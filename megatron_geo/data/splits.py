"""Megatron-LM's ``--split`` (``data.split``): train / valid / test parts of an indexed dataset, by sequence.

Rule: megatron-core 0.19, ``megatron/core/datasets/blended_megatron_dataset_config.py`` (parsing and normalising
the split string, ``parse_and_normalize_split``; the book-ends, ``convert_split_vector_to_split_matrix``) and
``blended_megatron_dataset_builder.py`` (the sequence bounds of each part, ``_build_megatron_dataset_splits``).
Runs checkpointed before this rule keep the earlier one (``rule="legacy"`` of :func:`split_ranges`).
"""

from __future__ import annotations

import math
import re

SPLIT_PARTS = 3  # train, valid, test
# how the part bounds follow from the fractions (split_ranges): megatron-core 0.19's, or this package's earlier one
SPLIT_RULES = ("megatron_core", "legacy")


def parse_split(text: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``) as 3 fractions summing to 1: the numbers of the string, padded with
    zeros to 3 parts (``"99,1"`` is ``99,1,0``), each >= 0, then divided by their sum.

    Returns:
        3 floats (train, valid, test), each in [0, 1], summing to 1.

    Raises:
        ValueError: an empty part, a part that is not a number (or negative, inf, nan), more than 3 parts, or
            all parts zero; the message names the value and shows a valid spelling.
    """
    fix = "write up to 3 non-negative numbers separated by ',' or '/', e.g. 969,30,1"
    raw = str(text).strip()
    if not raw:
        raise ValueError(f"split {text!r} is empty; {fix}.")
    parts = [p.strip() for p in re.split(r"[,/]", raw)]
    if len(parts) > SPLIT_PARTS:
        raise ValueError(f"split {text!r} has {len(parts)} parts, at most {SPLIT_PARTS} (train, valid, test); {fix}.")
    values = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            v = math.nan
        if not p or not math.isfinite(v) or v < 0:
            raise ValueError(f"split {text!r}: part {p!r} is not a non-negative number; {fix}.")
        values.append(v)
    values += [0.0] * (SPLIT_PARTS - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"split {text!r} gives every part 0; {fix}.")
    return [v / total for v in values]


def split_ranges(num_sequences: int, weights, rule: str = "megatron_core") -> list[tuple[int, int]]:
    """Sequence ranges ``[(0, a), (a, b), (b, n)]`` of the parts for ``n = num_sequences``.

    ``rule="megatron_core"`` (megatron-core 0.19: ``blended_megatron_dataset_config.py``,
    ``convert_split_vector_to_split_matrix``, and ``blended_megatron_dataset_builder.py``,
    ``_build_megatron_dataset_splits``): the book-ends ``0, w0, w0 + w1, w0 + w1 + w2`` (float64, summed in that
    order), each bound ``int(round(bookend * n))`` (Python's round, half to even). The bounds never decrease and the
    last is ``n`` (for ``n < 2**52``).

    ``rule="legacy"`` (this package's rule before, kept for runs checkpointed under it): bounds ``0, r0, r0 + r1,
    r0 + r1 + r2`` with ``r_k = int(round(w_k * n))``, then every bound after the first shifted by the same amount
    so that the last equals ``n``; in the small-``n`` corner where that would make a bound negative or a part
    inverted, each bound is clamped into ``[previous bound, n]``. The two rules give other bounds for some
    ``n`` (``90,5,5`` of 286 sequences: train ``[0, 257)`` by megatron-core's rule, ``[0, 258)`` by the legacy one).

    Args:
        num_sequences: sequences of the dataset (>= 0).
        weights: fractions per part as from :func:`parse_split` (non-negative numbers, used as given; under
            megatron-core's rule the parts end at ``n`` when they sum to 1, as :func:`parse_split`'s do).
        rule: ``"megatron_core"`` or ``"legacy"``.

    Returns:
        3 ``(start, stop)`` int pairs, contiguous from 0, covering ``[0, n)`` (see ``weights``); a part of weight 0
        is empty.

    Raises:
        ValueError: negative ``num_sequences``, not 3 non-negative finite weights, or another ``rule``.
    """
    n = int(num_sequences)
    if n < 0:
        raise ValueError(f"num_sequences={num_sequences} must be >= 0.")
    w = [float(x) for x in weights]
    if len(w) != SPLIT_PARTS or not all(math.isfinite(x) and x >= 0 for x in w):
        raise ValueError(f"split weights {weights!r}: expected {SPLIT_PARTS} non-negative numbers (parse_split).")
    if rule not in SPLIT_RULES:
        raise ValueError(f"split rule {rule!r}: expected one of {', '.join(SPLIT_RULES)}.")
    if rule == "megatron_core":
        bookends = [0.0]
        for x in w:
            bookends.append(bookends[-1] + x)
        bounds = [int(round(b * float(n))) for b in bookends]
        return [(bounds[k], bounds[k + 1]) for k in range(SPLIT_PARTS)]
    bounds = [0]
    for x in w:
        bounds.append(bounds[-1] + int(round(x * float(n))))
    diff = bounds[-1] - n
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    for k in range(1, len(bounds)):
        bounds[k] = min(max(bounds[k], bounds[k - 1]), n)
    return [(bounds[k], bounds[k + 1]) for k in range(SPLIT_PARTS)]
