"""Blends and splits against plain re-implementations written here: Megatron's greedy blending index (a loop over
samples and datasets), its --data-path and --split spellings and split bounds, and the data-parallel assignment of a
blend (resharding and resuming see the same samples)."""

import os

import numpy as np
import pytest

from megatron_geo.config import ConfigError
from megatron_geo.data import GPTDataset, GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder, dp_batch_indices
from megatron_geo.data.blending import (
    BlendedDataset,
    BlendingIndex,
    blending_index,
    parse_blend,
    samples_needed,
)
from megatron_geo.data.splits import parse_split, split_ranges

EOD = 2


def _reference_blend(weights, n):
    """The rule as a plain loop: weights / sum in float64; sample i goes to the first dataset with the largest
    w_d * max(i, 1) - count_d."""
    w = np.array(weights, dtype=np.float64)
    w = w / w.sum()
    counts = [0] * len(w)
    ds, cs = [], []
    for i in range(n):
        x = np.float64(max(i, 1))
        errors = [w[d] * x - np.float64(counts[d]) for d in range(len(w))]
        best = 0
        for d in range(1, len(w)):
            if errors[d] > errors[best]:
                best = d
        ds.append(best)
        cs.append(counts[best])
        counts[best] += 1
    return ds, cs


WEIGHT_SETS = [[0.3, 0.7], [1, 1], [1, 1, 1], [0.2] * 5, [0.1, 0.2, 0.3, 0.25, 0.15], [3, 1], [1.0], [7, 1e-3, 2]]


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_blending_index_matches_the_loop(weights):
    n = 3000
    want_d, want_c = _reference_blend(weights, n)
    d, c = blending_index(weights, n)
    assert d.dtype == np.int16 and c.dtype == np.int64 and d.shape == c.shape == (n,)
    assert d.tolist() == want_d and c.tolist() == want_c
    for chunk in (1, 7, 256, 5000):
        lazy = BlendingIndex(weights, chunk=chunk)
        got_d, got_c = lazy.arrays(n // 3)
        assert got_d.tolist() == want_d[: n // 3] and got_c.tolist() == want_c[: n // 3]
        got_d, got_c = lazy.arrays(n)  # extended past what was built
        assert got_d.tolist() == want_d and got_c.tolist() == want_c
        assert lazy.counts_at(n) == [want_d.count(k) for k in range(len(weights))]
    # ties (equal weights) go to the lowest dataset: plain round robin
    if len(set(weights)) == 1:
        assert want_d[: 2 * len(weights)] == list(range(len(weights))) * 2


def test_samples_needed_is_megatrons_sizing():
    assert samples_needed([0.3, 0.7], 1000) == [302, 704]  # ceil(301.5), ceil(703.5)
    assert samples_needed([1, 1], 10) == [6, 6]  # ceil(5.025)
    with pytest.raises(ValueError, match="positive finite"):
        samples_needed([1, 0], 10)


def test_parse_blend_spellings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a relative prefix is one under the launch's working directory
    assert parse_blend("0.3 a 0.7 b") == [(0.3, str(tmp_path / "a")), (0.7, str(tmp_path / "b"))]
    assert parse_blend("  2 /x/a\n1 /x/b ") == [(2.0, "/x/a"), (1.0, "/x/b")]
    assert parse_blend("a b c") == [(None, str(tmp_path / n)) for n in "abc"]
    monkeypatch.setenv("BLEND_ROOT", "/data/root")
    assert parse_blend("1 $BLEND_ROOT/a 1 ${BLEND_ROOT}/b") == [(1.0, "/data/root/a"), (1.0, "/data/root/b")]
    assert parse_blend("~/c") == [(None, os.path.expanduser("~/c"))]
    bad = [
        ("", "empty"),
        ("0.3 a 0.7", "odd count"),
        ("0 a 1 b", "'0' must be a positive"),
        ("-1 a 2 b", "'-1' must be a positive"),
        ("nan a 1 b", "'nan' must be a positive"),
        ("inf a 1 b", "'inf' must be a positive"),
        ("0.3 a b 0.7", "'b' stands where a weight belongs"),
        ("a 0.5 b", "'0.5' is a number among prefixes"),
        ("0.5 0.5 a b", "'0.5' stands where a prefix belongs"),
    ]
    for text, msg in bad:
        with pytest.raises(ValueError, match=msg):
            parse_blend(text)
    monkeypatch.delenv("NO_SUCH_BLEND_VAR", raising=False)
    with pytest.raises(ConfigError, match="NO_SUCH_BLEND_VAR"):
        parse_blend("1 $NO_SUCH_BLEND_VAR/a")


def test_parse_split_spellings():
    assert parse_split("969,30,1") == [969 / 1000, 30 / 1000, 1 / 1000]
    assert parse_split("969/30/1") == parse_split("969, 30, 1")
    assert parse_split("99,1") == [0.99, 0.01, 0.0]
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("0.5,0.5,0") == [0.5, 0.5, 0.0]
    for text, msg in [
        ("", "empty"),
        ("a,b", "'a' is not a non-negative number"),
        ("-1,2", "'-1' is not a non-negative number"),
        ("1,,2", "'' is not"),
        ("1,2,3,4", "4 parts, at most 3"),
        ("0,0,0", "every part 0"),
        ("1,nan", "'nan'"),
    ]:
        with pytest.raises(ValueError, match=msg) as err:
            parse_split(text)
        assert "969,30,1" in str(err.value)  # shows a valid spelling


def _reference_ranges(n, weights):
    """The legacy rule: cumulative rounded part sizes, every bound after the first shifted so that the last is n."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(n))))
    shift = bounds[-1] - n
    bounds = [0] + [b - shift for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


def test_split_ranges_legacy_rule():
    """The rule of runs checkpointed before megatron-core's (tests/test_megatron_core_split.py) was followed."""

    def legacy(n, w):
        return split_ranges(n, w, "legacy")

    assert legacy(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert legacy(10, parse_split("8,1,1")) == [(0, 8), (8, 9), (9, 10)]
    assert legacy(7, [1.0, 0.0, 0.0]) == [(0, 7), (7, 7), (7, 7)]
    assert legacy(0, [0.5, 0.5, 0.0]) == [(0, 0), (0, 0), (0, 0)]
    # round half to even: 2.5 -> 2, 2.5 -> 2, 0 -> 0; the bounds then shift by -1 so that the last is 5
    assert legacy(5, [0.5, 0.5, 0.0]) == [(0, 3), (3, 5), (5, 5)]
    assert split_ranges(5, [0.5, 0.5, 0.0]) == [(0, 2), (2, 5), (5, 5)]  # megatron-core's book-ends: 2.5 -> 2, 5
    for n in (1, 2, 3, 10, 97, 1000, 123457):
        for text in ("969,30,1", "1,1,1", "98,2", "1,0,1", "0.45,0.45,0.1", "2/1/1"):
            w = parse_split(text)
            want = _reference_ranges(n, w)
            if all(0 <= a <= b <= n for a, b in want):  # where the rule's bounds are valid: the same bounds
                assert legacy(n, w) == want, (n, text)
            for got in (legacy(n, w), split_ranges(n, w)):
                assert got[0][0] == 0 and got[-1][1] == n and all(a <= b for a, b in got)
                assert got[0][1] == got[1][0] and got[1][1] == got[2][0]
    # 0, round(1.5) = 2, round(1.5) = 2: shifting by +1 would give an invalid bound -1; clamped instead
    assert _reference_ranges(3, [0.0, 0.5, 0.5]) == [(0, -1), (-1, 1), (1, 3)]
    assert legacy(3, [0.0, 0.5, 0.5]) == [(0, 0), (0, 1), (1, 3)]
    with pytest.raises(ValueError, match="3 non-negative"):
        split_ranges(10, [1.0, 0.0])
    with pytest.raises(ValueError, match="split rule 'megatron'"):
        split_ranges(10, [1.0, 0.0, 0.0], "megatron")


def _component(tmp_path, name, seed, n_docs, **kw):
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(str(tmp_path / name), 300) as b:
        for _ in range(n_docs):
            doc = rng.integers(3, 300, int(rng.integers(2, 25)))
            doc[-1] = EOD
            b.add_document(doc)
    return GPTDataset(
        IndexedDataset(str(tmp_path / name)), GPTDatasetConfig(8, seed, eod_id=EOD, sample_order="megatron", **kw)
    )


def test_blended_dataset_follows_the_index_and_wraps_components(tmp_path):
    a, b = _component(tmp_path, "a", 1, 30), _component(tmp_path, "b", 2, 12)
    blend = BlendedDataset([a, b], [0.3, 0.7])
    assert len(blend) == len(a) + len(b)
    n = 4 * len(blend)  # the small component wraps into several epochs
    want_d, want_c = _reference_blend([0.3, 0.7], n)
    assert max(c for d, c in zip(want_d, want_c) if d == 1) > 2 * len(b)
    for g in range(n):
        comp = (a, b)[want_d[g]]
        assert blend.locate(g) == (want_d[g], want_c[g])
        assert blend.sample(g)["tokens"].tolist() == comp.sample(want_c[g])["tokens"].tolist()
    mb = blend.micro_batch([5, 6, 7])
    assert mb["tokens"].shape == (3, 8) and mb["tokens"][2].tolist() == blend.sample(7)["tokens"].tolist()
    assert blend.valid_tokens(range(10)) == 80
    # unweighted: the components' lengths are the weights
    plain = BlendedDataset([a, b])
    want_d, _ = _reference_blend([len(a), len(b)], 200)
    assert [plain.locate(g)[0] for g in range(200)] == want_d
    text = "\n".join(blend.describe(consumed_samples=1000))
    assert "weight 0.3" in text and "weight 0.7" in text and f"{len(b):,} samples per epoch" in text
    assert f"{700 / len(b):.3g} epochs" in text and "Megatron would build 704" in text


def test_blended_valid_tokens_with_eod_mask_loss(tmp_path):
    a = _component(tmp_path, "a", 1, 30, eod_mask_loss=True)
    b = _component(tmp_path, "b", 2, 12, eod_mask_loss=True)
    blend = BlendedDataset([a, b], [1, 2])
    gs = list(range(3, 60))
    assert blend.valid_tokens(gs) == int(blend.micro_batch(gs)["loss_mask"].sum())
    assert blend.valid_tokens(gs) < len(gs) * 8  # some inputs are eod


def test_blend_components_must_agree(tmp_path):
    a = _component(tmp_path, "a", 1, 30)
    c = _component(tmp_path, "c", 3, 30, reset_position_ids=True)
    with pytest.raises(ValueError, match="sample keys"):
        BlendedDataset([a, c], [1, 1])
    with pytest.raises(ValueError, match="2 weights for 1 datasets"):
        BlendedDataset([a], [1, 1])
    with pytest.raises(ValueError, match="positive finite"):
        BlendedDataset([a, a], [1, -1])


def test_dp_assignment_of_a_blend_reshards_and_resumes(tmp_path):
    """The union of the ranks' samples of a step is the single-rank step for DP 1/2/4, and a fresh blend
    resumed at a consumed counter gives the same samples as the run that got there."""

    def build():
        return BlendedDataset([_component(tmp_path, "a", 1, 30), _component(tmp_path, "b", 2, 12)], [0.4, 0.6])

    gbs, mbs, steps = 16, 2, 12
    ref = build()
    single = [
        [t for mb in dp_batch_indices(s * gbs, gbs, mbs, 0, 1) for t in ref.micro_batch(mb)["tokens"].tolist()]
        for s in range(steps)
    ]
    for dp in (1, 2, 4):
        for start in (0, 5):  # from scratch, and resumed at step 5 by a fresh dataset
            blend = build()
            for s in range(start, steps):
                got = []
                for r in range(dp):
                    for mb in dp_batch_indices(s * gbs, gbs, mbs, r, dp):
                        got += blend.micro_batch(mb)["tokens"].tolist()
                assert got == single[s], (dp, start, s)
