"""Where each parameter lives in a bucket's flat buffer and which DP rank owns which part.

A bucket's buffer is ``dp_size`` equal chunks of ``chunk`` elements; chunk r is DP rank r's shard (what
the reduce-scatter leaves on rank r and what the all-gather collects from it). Every parameter occupies
one contiguous range of the buffer, so its gradient is a plain view.

Two kinds of parameter:
- *atomic* parameters must be owned whole by one rank (Muon orthogonalises whole matrices; GeoFP8's
  inverse transform needs whole rows). They never cross a chunk boundary.
- *splittable* parameters (element-wise optimizers such as AdamW) may be cut at any element, as in
  Megatron's distributed optimizer, and fill the space the atomic ones leave, so padding stays small.

The chunk is the smallest size (searched upward from ``ceil(total / dp_size)``, rounded to ``align``)
for which a greedy packing places everything: per chunk, first the rest of a splittable parameter
carried over from the previous chunk, then atomic parameters largest first, then new splittable ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Piece:
    """Part ``[param_start, param_end)`` of parameter ``index`` (flattened), at ``buffer_start`` in the bucket."""

    index: int
    param_start: int
    param_end: int
    buffer_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass
class ShardPlan:
    """Layout of one bucket: ``offsets[i]`` is where parameter i starts; ``pieces[r]`` what rank r owns."""

    chunk: int
    dp_size: int
    offsets: list[int]
    pieces: list[list[Piece]] = field(default_factory=list)

    @property
    def buffer_numel(self) -> int:
        return self.chunk * self.dp_size

    def padding(self, numels: list[int]) -> int:
        """Elements of the buffer that hold no parameter."""
        return self.buffer_numel - sum(numels)


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _try_pack(numels: list[int], atomic: list[bool], dp: int, chunk: int) -> ShardPlan | None:
    atoms = sorted((i for i, a in enumerate(atomic) if a), key=lambda i: (-numels[i], i))
    splits = [i for i, a in enumerate(atomic) if not a]
    offsets = [0] * len(numels)
    pieces: list[list[Piece]] = [[] for _ in range(dp)]
    carry_idx, carry_done = None, 0  # splittable param in progress and how much of it is placed
    si = 0
    for r in range(dp):
        pos, end = r * chunk, (r + 1) * chunk
        if carry_idx is not None:
            n = min(numels[carry_idx] - carry_done, end - pos)
            pieces[r].append(Piece(carry_idx, carry_done, carry_done + n, pos))
            pos += n
            carry_done += n
            if carry_done == numels[carry_idx]:
                carry_idx = None
        if carry_idx is None:
            remaining = []
            for i in atoms:
                if numels[i] <= end - pos:
                    offsets[i] = pos
                    pieces[r].append(Piece(i, 0, numels[i], pos))
                    pos += numels[i]
                else:
                    remaining.append(i)
            atoms = remaining
            while pos < end and si < len(splits):
                i = splits[si]
                si += 1
                offsets[i] = pos
                n = min(numels[i], end - pos)
                if n:
                    pieces[r].append(Piece(i, 0, n, pos))
                pos += n
                if n < numels[i]:
                    carry_idx, carry_done = i, n
            # zero-size splittables at the very end still need an offset
    while si < len(splits) and numels[splits[si]] == 0:
        offsets[splits[si]] = dp * chunk
        si += 1
    if atoms or carry_idx is not None or si < len(splits):
        return None
    return ShardPlan(chunk, dp, offsets, pieces)


def plan_shards(numels: list[int], atomic: list[bool], dp_size: int, align: int = 1) -> ShardPlan:
    """Pack parameters of one bucket into ``dp_size`` equal chunks.

    Args:
        numels: element count of each parameter (in bucket order).
        atomic: True where the parameter must be owned whole by one rank.
        dp_size: number of data-parallel ranks (>= 1).
        align: chunk size is a multiple of this (e.g. a quantisation block size, so blocks never straddle
            two ranks' shards).

    Returns:
        A :class:`ShardPlan`; every element of every parameter is owned by exactly one rank.
    """
    if dp_size < 1 or align < 1:
        raise ValueError(f"dp_size={dp_size} and align={align} must be >= 1")
    total = sum(numels)
    biggest = max((n for n, a in zip(numels, atomic) if a), default=0)
    chunk = _ceil_to(max(math.ceil(total / dp_size), biggest, 1), align)
    while True:
        plan = _try_pack(numels, atomic, dp_size, chunk)
        if plan is not None:
            return plan
        chunk = _ceil_to(chunk + max(1, chunk // 32), align)
