"""Weighted blends of datasets, as Megatron-LM's ``--data-path 0.3 PREFIX_A 0.7 PREFIX_B``.

Sample ``g`` of a blend is sample ``c`` of component ``d``, where ``(d, c)`` come from megatron-core's greedy
blending index (``megatron/core/datasets/helpers.cpp``, ``build_blending_indices``): sample ``i`` goes to the
component with the largest ``w_d * max(i, 1) - count_d`` (float64; ties to the lowest ``d``), whose count then grows
by one; ``c`` is that count before the increment.

The weights ``w`` are those of megatron-core 0.19 (``rule="megatron_core"``): written weights are normalised twice,
once by the builder (``blended_megatron_dataset_builder.py``, ``build``, with ``utils.py``'s ``normalize``) and once
more by its ``BlendedDataset`` (``blended_dataset.py``, ``__init__``) before ``build_blending_indices``. Weights
whose float64 sum is not exactly 1 (``0.6 0.3 0.1`` sums to ``0.9999999999999999``) give another order than a single
normalisation: megatron-core's sample 2 of that blend comes from component 2. ``rule="legacy"`` normalises once (this
package's earlier order, kept for runs checkpointed under it). Without weights (prefixes alone) the weights are the
components' samples per epoch, normalised once under both rules (megatron-core's unweighted blend).

Megatron-core also sizes each component up front: ``ceil(ceil(N * w_d) * 1.005)`` samples for a run of ``N``
(:func:`samples_needed`, the builder's ``_get_size_per_split_per_dataset`` with ``mid_level_dataset_surplus``). That
plan decides how the component's own order is built (``gpt_dataset.megatron_plan``); here it is passed to each
component as ``planned_samples``. Components still wrap into later epochs (their ``sample(c)`` takes any counter).

A blend may continue from a position (``start``, ``start_counts``): after a change of weights on a resume each
component goes on from the samples it had given, and the greedy rule runs afresh over the samples from ``start`` on
(:class:`BlendingIndex`).

The index is sequential by nature. It is computed lazily, in chunks of ``2**16`` samples, as higher counters are
asked for, by a plain loop over samples (a handful of float operations per component). Measured on a shared
2-core machine: 10**7 samples in about 4 s with 2 components and about 8 s with 5 (0.4 and 0.8 microseconds
per sample); a run pays it once, spread over its steps, and a resume at counter ``N`` pays it for ``N`` samples
at start-up.

Unweighted blends (prefixes alone): the weights are the components' samples per epoch, and megatron-core builds
each component as one epoch and the blend for at most their total (``min(N, total)`` samples; the same order up to
there). Past that total, or when megatron-core is given no size (its exhaustive variant, which differs once a
component is used up), components here go on into their next epochs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from .gpt_dataset import SampleDataset, collate

BLEND_CHUNK = 1 << 16  # samples added to the lazy blending index at a time
MAX_DATASETS = 2**15 - 1  # the dataset index is int16, as Megatron's
# megatron-core's BlendedMegatronDatasetConfig.mid_level_dataset_surplus: components are sized 0.5% above their share
MID_LEVEL_SURPLUS = 0.005
# how written weights become the greedy rule's: megatron-core 0.19's two normalisations, or this package's earlier one
BLEND_RULES = ("megatron_core", "legacy")


def _weight(token: str) -> float | None:
    """``token`` as a number, or None when it does not read as one."""
    try:
        return float(token)
    except ValueError:
        return None


def parse_blend(text: str, key: str = "blend") -> list[tuple[float | None, str]]:
    """Megatron-LM's ``--data-path`` spelling: ``"0.3 PREFIX_A 0.7 PREFIX_B"`` (weight, prefix, alternating) or
    prefixes alone ``"PREFIX_A PREFIX_B"``; whitespace-separated. A prefix may start with ``~`` or hold ``$VAR``
    (expanded by ``megatron_geo.config.loader.expand_path``; ``key`` names the value in its error).

    Returns:
        ``(weight, prefix)`` pairs in order; weights as written (not normalised), None when prefixes alone.

    Raises:
        ValueError: an empty blend, an odd token count in the weighted form, a weight that is not a positive
            finite number, a number where a prefix belongs (or a prefix where a weight belongs: mixed forms); the
            message names the bad token and the fix. ``ConfigError`` (a ValueError) for an unset ``$VAR``.
    """
    from ..config.loader import expand_path

    tokens = str(text).split()
    example = "e.g. '0.3 /data/a_text_document 0.7 /data/b_text_document' or prefixes alone '/data/a /data/b'"
    if not tokens:
        raise ValueError(f"the blend is empty; give weights and prefixes, {example}.")
    if _weight(tokens[0]) is None:  # prefixes alone
        for t in tokens:
            if _weight(t) is not None:
                raise ValueError(
                    f"{t!r} is a number among prefixes without weights (mixed forms); give every prefix a weight "
                    f"before it, or none, {example}."
                )
        return [(None, expand_path(t, key)) for t in tokens]
    if len(tokens) % 2:
        raise ValueError(
            f"the weighted blend has {len(tokens)} tokens, an odd count; write a weight before every prefix, {example}."
        )
    out: list[tuple[float | None, str]] = []
    for w_tok, p_tok in zip(tokens[0::2], tokens[1::2]):
        w = _weight(w_tok)
        if w is None:
            raise ValueError(
                f"{w_tok!r} stands where a weight belongs but is not a number (mixed forms?); write a weight "
                f"before every prefix, or none, {example}."
            )
        if not math.isfinite(w) or w <= 0:
            raise ValueError(
                f"weight {w_tok!r} must be a positive finite number (e.g. 0.3; weights are normalised to sum 1); "
                f"to leave a dataset out, drop it and its weight."
            )
        if _weight(p_tok) is not None:
            raise ValueError(
                f"{p_tok!r} stands where a prefix belongs but is a number (two weights in a row?); {example}."
            )
        out.append((w, expand_path(p_tok, key)))
    return out


def normalize_weights(weights) -> np.ndarray:
    """Weights as float64 [D] divided by their sum (Megatron-Core ``datasets/utils.py``, ``normalize``).

    Raises:
        ValueError: no weights, more than 32767, or one that is not a positive finite number.
    """
    w = np.asarray(list(weights), dtype=np.float64)
    if w.ndim != 1 or not w.size:
        raise ValueError(f"weights {weights!r}: expected a non-empty list of numbers.")
    if w.size > MAX_DATASETS:
        raise ValueError(f"{w.size} datasets in a blend; at most {MAX_DATASETS} (the dataset index is int16).")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights {list(weights)!r}: each must be a positive finite number.")
    return w / np.sum(w)


def samples_needed(weights, n: int) -> list[int]:
    """Megatron-core's planned size of each component for ``n`` blended samples: ``ceil(ceil(n * w_d) * (1 +
    0.005))`` (float64) with ``w`` normalised once, as its builder does (``blended_megatron_dataset_builder.py``,
    ``_get_size_per_split_per_dataset`` with ``mid_level_dataset_surplus=0.005``).

    Returns:
        One int per weight: the samples megatron-core builds for that component (its ``num_samples``).

    Raises:
        ValueError: bad weights (:func:`normalize_weights`) or ``n < 0``.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0.")
    return [int(math.ceil(math.ceil(n * float(w)) * (1 + MID_LEVEL_SURPLUS))) for w in normalize_weights(weights)]


def greedy_weights(weights, rule: str = "megatron_core") -> np.ndarray:
    """The weights the greedy rule of a weighted blend runs with, float64 [D]: the written ``weights`` normalised
    twice (``rule="megatron_core"``: megatron-core's builder, then its ``BlendedDataset``) or once
    (``rule="legacy"``).

    Raises:
        ValueError: bad weights (:func:`normalize_weights`) or another ``rule``.
    """
    if rule not in BLEND_RULES:
        raise ValueError(f"blend rule {rule!r}: expected one of {', '.join(BLEND_RULES)}.")
    w = normalize_weights(weights)
    return normalize_weights(w) if rule == "megatron_core" else w


def _greedy(w: list[float], counts: list[int], i0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``i0 .. i0 + n - 1`` of the greedy rule from ``counts`` (updated in place)."""
    d_out = [0] * n
    c_out = [0] * n
    if len(w) == 2:  # the common blend, the same rule with the inner loop unrolled
        w0, w1 = w
        c0, c1 = counts
        for k, i in enumerate(range(i0, i0 + n)):
            x = float(i) if i > 1 else 1.0
            if w1 * x - c1 > w0 * x - c0:
                d_out[k] = 1
                c_out[k] = c1
                c1 += 1
            else:
                c_out[k] = c0
                c0 += 1
        counts[0], counts[1] = c0, c1
    else:
        rest = list(enumerate(w))[1:]
        wf = w[0]
        for k, i in enumerate(range(i0, i0 + n)):
            x = float(i) if i > 1 else 1.0
            best, top = 0, wf * x - counts[0]
            for d, wd in rest:
                e = wd * x - counts[d]
                if e > top:
                    best, top = d, e
            d_out[k] = best
            c_out[k] = counts[best]
            counts[best] += 1
    return np.asarray(d_out, dtype=np.int16), np.asarray(c_out, dtype=np.int64)


def greedy_counts(weights, n: int) -> list[int]:
    """Samples each component gives in the first ``n`` samples of the greedy rule (module docstring) run with
    ``weights`` exactly as given (float64, not normalised again: e.g. a ``BlendedDataset``'s ``weights``); computed
    in chunks of ``BLEND_CHUNK`` samples (memory bounded, time as :class:`BlendingIndex`).

    Raises:
        ValueError: ``n < 0``.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0.")
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    for i0 in range(0, n, BLEND_CHUNK):
        _greedy(w, counts, i0, min(BLEND_CHUNK, n - i0))
    return counts


class BlendingIndex:
    """Megatron's blending index (module docstring), built lazily in chunks of ``chunk`` samples.

    Counter ``g >= start`` is sample ``i = g - start`` of the greedy rule run from zero counts; its component
    counter is ``start_counts[d]`` plus that component's count within the rule. ``start=0`` with zero counts is
    megatron-core's index.

    Args:
        weights: positive numbers, one per component (normalised here once, as megatron-core's
            ``build_blending_indices`` receives them from its ``BlendedDataset``).
        chunk: samples added at a time (>= 1).
        start: the first blended counter of the index (>= 0).
        start_counts: samples each component had given before ``start`` (ints >= 0; default zeros).

    Raises:
        ValueError: bad weights, a negative ``start`` or count, or a count list of another length.
    """

    def __init__(self, weights, chunk: int = BLEND_CHUNK, start: int = 0, start_counts=None):
        self.weights = normalize_weights(weights)
        self.chunk = max(1, int(chunk))
        self._w = [float(x) for x in self.weights]
        self.start = int(start)
        counts = [0] * len(self._w) if start_counts is None else [int(c) for c in start_counts]
        if self.start < 0 or len(counts) != len(self._w) or any(c < 0 for c in counts):
            raise ValueError(
                f"start={start} and start_counts={start_counts!r}: expected start >= 0 and {len(self._w)} counts >= 0."
            )
        self.start_counts = np.asarray(counts, dtype=np.int64)
        self._counts = [0] * len(self._w)
        self._dataset: list[np.ndarray] = []
        self._sample: list[np.ndarray] = []
        self._built = 0
        self._flat: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        """Samples built so far (from ``start`` on)."""
        return self._built

    def ensure(self, n: int) -> None:
        """Build the index up to at least ``n`` samples (whole chunks)."""
        while self._built < n:
            d, c = _greedy(self._w, self._counts, self._built, self.chunk)
            self._dataset.append(d)
            self._sample.append(c)
            self._built += self.chunk
            self._flat = None

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_index int16 [n], dataset_sample_index int64 [n])`` of the first ``n`` samples of the greedy
        rule (counters ``start .. start + n - 1``; the sample indices without ``start_counts``)."""
        self.ensure(n)
        if self._flat is None:
            self._flat = (np.concatenate(self._dataset), np.concatenate(self._sample))
            self._dataset, self._sample = [self._flat[0]], [self._flat[1]]
        return self._flat[0][:n], self._flat[1][:n]

    def lookup(self, gs) -> tuple[np.ndarray, np.ndarray]:
        """``(component, component counter)`` int64 arrays for the blended counters ``gs`` (ints >= ``start``).

        Raises:
            ValueError: a counter below ``start`` (before the position this index continues from).
        """
        g = np.asarray(gs, dtype=np.int64).reshape(-1) - self.start
        if g.size and int(g.min()) < 0:
            raise ValueError(
                f"blended sample counter {int(g.min()) + self.start} is below {self.start}, where this blend starts."
            )
        d, c = self.arrays(int(g.max()) + 1 if g.size else 0)
        d = d[g].astype(np.int64)
        return d, c[g] + self.start_counts[d]

    def counts_at(self, n: int) -> list[int]:
        """Samples each component has given before blended counter ``n >= start`` (``start_counts`` included;
        exact; builds the index up to ``n``).

        Raises:
            ValueError: ``n < start``.
        """
        if int(n) < self.start:
            raise ValueError(f"n={n} is below {self.start}, where this blend starts.")
        d, _ = self.arrays(int(n) - self.start)
        return (np.bincount(d, minlength=len(self._w)) + self.start_counts).tolist()


def blending_index(weights, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's blending index of ``n`` samples in one go (module docstring; Megatron-Core ``helpers.cpp``,
    ``build_blending_indices``).

    Returns:
        ``dataset_index`` int16 [n] (the component of each sample) and ``dataset_sample_index`` int64 [n] (the
        sample of that component: how many it had given before).

    Raises:
        ValueError: bad weights (:func:`normalize_weights`) or ``n < 0``.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0.")
    w = [float(x) for x in normalize_weights(weights)]
    return _greedy(w, [0] * len(w), 0, n)


class BlendedDataset:
    """A weighted blend of datasets with the `SampleDataset` protocol: ``sample(g)`` is
    ``datasets[d].sample(c)`` for ``(d, c)`` of the blending index at ``g``.

    Args:
        datasets: components (`GPTDataset` or any `SampleDataset`), the same ``seq_length`` and sample keys.
        weights: positive numbers, one per component (normalised by :func:`greedy_weights` under ``rule``);
            None: each component's ``len()`` (normalised once).
        names: labels for `describe` (default: each component's ``prefix`` attribute, else its position).
        rule: ``"megatron_core"`` (default) or ``"legacy"`` (module docstring).

    Raises:
        ValueError: no components, more than 32767, a weight count that differs from the components, a bad
            weight or rule, or components whose ``seq_length`` or sample keys differ (their batches would not
            stack).
    """

    def __init__(
        self,
        datasets: Sequence[SampleDataset],
        weights=None,
        names: Sequence[str] | None = None,
        *,
        rule: str = "megatron_core",
    ):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("BlendedDataset needs at least one dataset.")
        if rule not in BLEND_RULES:
            raise ValueError(f"blend rule {rule!r}: expected one of {', '.join(BLEND_RULES)}.")
        weighted = weights is not None
        if weights is None:
            weights = [len(ds) for ds in self.datasets]
        weights = list(weights)
        if len(weights) != len(self.datasets):
            raise ValueError(f"{len(weights)} weights for {len(self.datasets)} datasets; give one per dataset.")
        self.names = (
            list(names) if names is not None else [str(getattr(ds, "prefix", i)) for i, ds in enumerate(datasets)]
        )
        first = self.datasets[0]
        for name, ds in zip(self.names, self.datasets):
            if ds.seq_length != first.seq_length or tuple(ds.sample_keys) != tuple(first.sample_keys):
                raise ValueError(
                    f"blend component {name} has seq_length={ds.seq_length} and sample keys {list(ds.sample_keys)}, "
                    f"but {self.names[0]} has {first.seq_length} and {list(first.sample_keys)}; build every "
                    f"component with the same seq_length and options."
                )
        self.seq_length = first.seq_length
        self.sample_keys = tuple(first.sample_keys)
        self.rule = rule
        self._written = weights  # as given (or the lengths): what megatron-core's builder sizes the components by
        # megatron-core's builder normalises written weights once; BlendingIndex normalises again, as its BlendedDataset
        self._index_weights = normalize_weights(weights) if weighted and rule == "megatron_core" else weights
        self.index = BlendingIndex(self._index_weights)
        self.weights = self.index.weights  # float64 [D]: the weights of the greedy rule

    def continue_from(self, start: int, start_counts) -> None:
        """Continue the blend from blended counter ``start``, where the components had given ``start_counts``
        samples: counters from ``start`` on follow the greedy rule afresh over these weights (:class:`BlendingIndex`);
        counters below ``start`` are no longer available.

        Raises:
            ValueError: a negative ``start`` or count, or a count list of another length than the components.
        """
        self.index = BlendingIndex(self._index_weights, self.index.chunk, start, start_counts)

    def __len__(self) -> int:
        """Samples of one epoch of every component together: the sum of their lengths."""
        return sum(len(ds) for ds in self.datasets)

    def locate(self, g: int) -> tuple[int, int]:
        """``(component, component counter)`` of the blended counter ``g`` (>= the index's ``start``, 0 unless
        :meth:`continue_from` moved it)."""
        d, c = self.index.lookup([g])
        return int(d[0]), int(c[0])

    def sample(self, g: int) -> dict[str, torch.Tensor]:
        """The blended sample at global counter ``g`` (as :meth:`locate`; keys and shapes: `SampleDataset`)."""
        d, c = self.locate(g)
        return self.datasets[d].sample(c)

    def micro_batch(self, global_samples: list[int]) -> dict[str, torch.Tensor]:
        """Collated samples of these global counters: each key as [len(global_samples), S]."""
        d, c = self.index.lookup(global_samples)
        return collate([self.datasets[int(a)].sample(int(b)) for a, b in zip(d, c)])

    def valid_tokens(self, global_samples) -> int:
        """Loss-bearing tokens of these samples: the components' ``valid_tokens`` of their counters (without
        ``eod_mask_loss`` in any component, ``seq_length`` each, without looking the samples up)."""
        if not any(getattr(ds, "eod_mask_loss", False) for ds in self.datasets):
            return len(global_samples) * self.seq_length
        d, c = self.index.lookup(list(global_samples))
        per: dict[int, list[int]] = defaultdict(list)
        for a, b in zip(d.tolist(), c.tolist()):
            per[a].append(b)
        return sum(self.datasets[a].valid_tokens(cs) for a, cs in per.items())

    def describe(self, consumed_samples: int | None = None) -> list[str]:
        """Start-up facts: one line per component (normalised weight, samples per epoch and, for
        ``consumed_samples`` blended samples, about ``w_d * consumed_samples`` of its samples, i.e. how many of
        its epochs that is, and Megatron's :func:`samples_needed` size), then each component's own lines."""
        lines = [f"blend of {len(self.datasets)} datasets, {len(self):,} samples per epoch of all components"]
        n = consumed_samples
        needed = samples_needed(self._written, n) if n is not None else []
        for k, (name, ds, w) in enumerate(zip(self.names, self.datasets, self.weights)):
            line = f"  [{k}] weight {w:.6g}: {name}, {len(ds):,} samples per epoch"
            if n is not None:
                share = float(w) * n
                line += (
                    f"; {n:,} blended samples take about {share:,.0f} of them = "
                    f"{share / len(ds):.3g} epochs (Megatron would build {needed[k]:,})"
                )
            lines.append(line)
            lines += [f"      {x}" for x in ds.describe()]
        return lines
