"""Split bounds, blend order and blend component plans against megatron-core 0.19's rules, re-implemented here from
its documented behaviour as plain loops (not the package's code):

- split: the split string's numbers (padded to 3) divided by their float64 sum, cumulative book-ends
  ``0, w0, w0 + w1, w0 + w1 + w2``, each bound ``int(round(bookend * n))`` (``blended_megatron_dataset_config.py``
  and ``blended_megatron_dataset_builder.py``);
- blend: written weights divided by their sum twice (the builder, then ``BlendedDataset``), then the greedy rule of
  ``helpers.cpp`` ``build_blending_indices``;
- component plan: ``ceil(ceil(N * w) * (1 + 0.005))`` samples (``_get_size_per_split_per_dataset``), laid out as
  ``gpt_dataset.py`` does: enough epochs for the plan, a final epoch shuffled apart when short, the document index
  shuffled per part, then the sample shuffle from the same ``RandomState``;
- a resume after a change of blend weights continues each component from the samples it had given, and a checkpoint
  saved before the rule was recorded keeps the legacy rule.
"""

from __future__ import annotations

import functools
import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from ckpt_helpers import make_corpus
from megatron_geo.config import config_to_dict, load_config
from megatron_geo.data import IndexedDataset, IndexedDatasetBuilder, Tokenizer
from megatron_geo.data.blending import BlendedDataset
from megatron_geo.data.splits import parse_split, split_ranges
from megatron_geo.training.data_setup import build_data

PCTX = SimpleNamespace(rank=0, world_group=None, dp_rank=0, dp_size=1)
S = 8  # model.seq_length of these tests
SEED = 1234


# ---------------------------------------------------------------- megatron-core's rules, written out


def mc_normalize(weights) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def mc_split_bounds(text: str, n: int) -> list[tuple[int, int] | None]:
    parts = [float(x) for x in re.findall(r"[.0-9]+", text)]
    parts += [0.0] * (3 - len(parts))
    fractions = mc_normalize(parts)
    ends = functools.reduce(lambda acc, x: acc + [acc[-1] + x], fractions, [0])
    out: list[tuple[int, int] | None] = []
    for lo, hi in zip(ends[:-1], ends[1:]):
        out.append(None if hi <= lo else (int(round(lo * float(n))), int(round(hi * float(n)))))
    return out


def mc_greedy(weights: list[float], n: int) -> tuple[list[int], list[int]]:
    counts = [0] * len(weights)
    ds, cs = [], []
    for i in range(n):
        x = max(float(i), 1.0)
        best, top = 0, weights[0] * x - float(counts[0])
        for d in range(1, len(weights)):
            e = weights[d] * x - float(counts[d])
            if e > top:
                best, top = d, e
        ds.append(best)
        cs.append(counts[best])
        counts[best] += 1
    return ds, cs


def mc_blend_weights(written) -> list[float]:
    return mc_normalize(mc_normalize(written))


def mc_component_sizes(written, n: int) -> list[int]:
    return [int(math.ceil(math.ceil(n * w) * (1 + 0.005))) for w in mc_normalize(written)]


class MCOrder:
    """One GPTDataset of megatron-core over sequences ``docs`` planned at ``num_samples`` (None: one epoch)."""

    def __init__(self, ix: IndexedDataset, docs: np.ndarray, seq: int, seed: int, num_samples: int | None):
        sizes = np.asarray(ix.sizes, dtype=np.int64)
        per_epoch_tokens = int(sizes[docs].sum())
        epochs = 1
        if num_samples is not None:
            while epochs * per_epoch_tokens < num_samples * seq + 1:
                epochs += 1
        separate = False
        if epochs > 1:
            before_final = ((epochs - 1) * per_epoch_tokens - 1) // seq
            per_epoch = (per_epoch_tokens - 1) // seq
            separate = num_samples - before_final < int(0.80 * per_epoch)
        rs = np.random.RandomState(seed)

        def doc_index(k: int) -> np.ndarray:
            a = np.tile(np.asarray(docs, dtype=np.int32), k)
            rs.shuffle(a)
            return a

        order = np.concatenate([doc_index(epochs - 1), doc_index(1)]) if separate else doc_index(epochs)
        self.stream = np.concatenate([np.asarray(ix[int(k)], dtype=np.int64) for k in order])
        total = (epochs * per_epoch_tokens - 1) // seq
        if separate:
            first = np.arange(before_final)
            rs.shuffle(first)
            last = np.arange(before_final, total)
            rs.shuffle(last)
            self.shuffle = np.concatenate([first, last])
        else:
            self.shuffle = np.arange(total)
            rs.shuffle(self.shuffle)
        self.epochs, self.separate, self.seq = epochs, separate, seq

    def tokens(self, c: int) -> list[int]:
        j = int(self.shuffle[c])
        return self.stream[j * self.seq : j * self.seq + self.seq + 1][:-1].tolist()


# ---------------------------------------------------------------- data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer, and indexed datasets of random ids ending with the end-of-document id: ``p286`` (286 sequences),
    ``a`` (small), ``b`` and ``c`` (larger)."""
    root = tmp_path_factory.mktemp("mc")
    base = make_corpus(root)
    tok_model = next(o.split("=", 1)[1] for o in base if o.startswith("data.tokenizer_model="))
    tok = Tokenizer(tok_model)
    rng = np.random.default_rng(7)
    for name, n_docs in (("p286", 286), ("a", 500), ("b", 1000), ("c", 300)):
        with IndexedDatasetBuilder(str(root / name), vocab_size=tok.vocab_size) as b:
            for _ in range(n_docs):
                doc = rng.integers(3, tok.vocab_size, int(rng.integers(3, 30)))
                doc[-1] = tok.eod_id
                b.add_document(doc)
    keep = [o for o in base if not o.startswith(("data.train_prefix", "data.valid_prefix"))]
    return SimpleNamespace(root=root, overrides=keep)


def _cfg(corpus, *extra):
    return load_config(
        [],
        [
            *corpus.overrides,
            f"model.seq_length={S}",
            f"train.seed={SEED}",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "train.eval_batches=1",
            *extra,
        ],
    )


# ---------------------------------------------------------------- split


SPLITS = ["969,30,1", "90,5,5", "98,2", "1,1,1", "0.45,0.45,0.1", "2/1/1", "99,1,0", "1,0,1", "8,1,1"]


def test_split_bounds_are_megatron_cores():
    sizes = [1, 2, 3, 5, 7, 10, 97, 286, 1000, 123_457, 63_732_472]
    sizes += np.random.default_rng(0).integers(10**5, 10**8, 300).tolist()
    for text in SPLITS:
        for n in sizes:
            want = mc_split_bounds(text, int(n))
            got = split_ranges(int(n), parse_split(text))
            for g, w in zip(got, want):
                if w is None:  # a part of weight 0: megatron-core builds none, here it is empty
                    assert g[0] == g[1], (text, n, got, want)
                else:
                    assert g == w, (text, n, got, want)
    # the values where the earlier rule differed
    assert split_ranges(286, parse_split("90,5,5")) == [(0, 257), (257, 272), (272, 286)]
    assert split_ranges(63_732_472, parse_split("969,30,1"))[0] == (0, 61_756_765)
    # the earlier rule is kept, by name, for runs checkpointed under it
    assert split_ranges(286, parse_split("90,5,5"), "legacy")[0] == (0, 258)
    assert split_ranges(63_732_472, parse_split("969,30,1"), "legacy")[0] == (0, 61_756_766)


def test_split_samples_are_megatron_cores(corpus):
    """data.split=90,5,5 of 286 sequences: the train part is sequences 0..256 and its samples are megatron-core's."""
    cfg = _cfg(corpus, f"data.train_prefix={corpus.root}/p286", "data.split=90,5,5", "train.steps=20")
    data = build_data(cfg, PCTX)
    assert (data.train.start, data.train.stop) == (0, 257)
    assert (data.valid.start, data.valid.stop) == (257, 272)
    ix = IndexedDataset(str(corpus.root / "p286"))
    want = MCOrder(ix, np.arange(0, 257), S, SEED, 40)
    assert want.epochs == 1
    for g in range(len(data.train)):
        assert data.train.sample(g)["tokens"].tolist() == want.tokens(g), g


# ---------------------------------------------------------------- blend weights


def test_blend_weights_are_normalised_twice(corpus):
    """0.6/0.3/0.1 sums to 0.9999999999999999: megatron-core's second normalisation gives another greedy order."""
    written = [0.6, 0.3, 0.1]
    n = 100_000
    want_d, want_c = mc_greedy(mc_blend_weights(written), n)
    once_d, _ = mc_greedy(mc_normalize(written), n)
    assert sum(a != b for a, b in zip(want_d, once_d)) == 14_612  # the two rules part ways this often
    assert (want_d[2], want_c[2]) == (2, 0)  # megatron-core's sample 2 is dataset 2's sample 0

    blend = f"data.train_blend=0.6 {corpus.root}/a 0.3 {corpus.root}/b 0.1 {corpus.root}/c"
    data = build_data(_cfg(corpus, blend, "train.steps=10"), PCTX)
    d, c = data.train.index.lookup(np.arange(n))
    assert d.tolist() == want_d and c.tolist() == want_c
    assert data.train.locate(2) == (2, 0)
    legacy = BlendedDataset(data.train.datasets, written, rule="legacy")
    assert legacy.locate(2) == (0, 1)  # the earlier single normalisation, kept by name
    # weights that sum to exactly 1.0 give one order under both rules
    for w in ([0.3, 0.7], [0.5, 0.3, 0.2]):
        assert mc_greedy(mc_blend_weights(w), 5000) == mc_greedy(mc_normalize(w), 5000)


# ---------------------------------------------------------------- component plans (the 0.5% surplus)


@pytest.mark.parametrize("use", [1.0, 0.996, 0.99])
def test_a_component_used_at_99_5_to_100_percent_takes_megatron_cores_two_epoch_order(corpus, use):
    """Blend 0.5 a 0.5 b over a run that uses ``use`` of a's epoch: megatron-core plans ceil(ceil(N/2) * 1.005)
    samples of a, two epochs when that passes one epoch; every blended sample equals megatron-core's."""
    ix_a, ix_b = IndexedDataset(str(corpus.root / "a")), IndexedDataset(str(corpus.root / "b"))
    per_epoch_a = (int(np.asarray(ix_a.sizes, dtype=np.int64).sum()) - 1) // S
    steps = int(use * per_epoch_a)  # global batch 2: N = 2 * steps, a gives ceil(N / 2) = steps samples
    blend = f"data.train_blend=0.5 {corpus.root}/a 0.5 {corpus.root}/b"
    data = build_data(_cfg(corpus, blend, f"train.steps={steps}"), PCTX)
    n = 2 * steps
    plan = mc_component_sizes([0.5, 0.5], n)
    orders = [MCOrder(ix, np.arange(len(ix)), S, SEED, p) for ix, p in ((ix_a, plan[0]), (ix_b, plan[1]))]
    assert orders[0].epochs == (2 if use > 0.995 else 1) and orders[1].epochs == 1
    assert orders[0].separate == (use > 0.995)
    want_d, want_c = mc_greedy(mc_blend_weights([0.5, 0.5]), n)
    assert max(c for d, c in zip(want_d, want_c) if d == 0) == steps - 1  # a is used at `use` of its epoch
    for g in range(n):
        got = data.train.sample(g)["tokens"].tolist()
        assert got == orders[want_d[g]].tokens(want_c[g]), (g, want_d[g], want_c[g])
    assert [ds.planned_samples for ds in data.train.datasets] == plan


# ---------------------------------------------------------------- resume


def _meta(cfg, data, consumed: int) -> dict:
    """What a checkpoint of ``data`` at ``consumed`` samples records, through JSON as meta.json holds it."""
    return json.loads(json.dumps({"config": config_to_dict(cfg), "data": data.record, "consumed_samples": consumed}))


def test_a_blend_weight_change_on_resume_continues_every_component(corpus):
    """0.3/0.7 -> 0.5/0.5 after 512,000 samples: a continues at its sample 153,600 and b at 358,400 (restarting the
    index from sample 0 with the new weights would skip 102,400 of a and replay 102,400 of b)."""
    from megatron_geo.training.data_setup import resume_data

    a, b = corpus.root / "a", corpus.root / "b"
    consumed = 512_000
    old_cfg = _cfg(corpus, f"data.train_blend=0.3 {a} 0.7 {b}", "train.steps=300000")
    old = build_data(old_cfg, PCTX)
    old_d, old_c = mc_greedy(mc_blend_weights([0.3, 0.7]), consumed)
    had = [old_d.count(0), old_d.count(1)]
    assert had == [153_600, 358_400]
    restart_d, _ = mc_greedy(mc_blend_weights([0.5, 0.5]), consumed)
    assert [restart_d.count(0) - had[0], had[1] - restart_d.count(1)] == [102_400, 102_400]

    new_cfg = _cfg(
        corpus, f"data.train_blend=0.5 {a} 0.5 {b}", "train.steps=300000", "checkpoint.allow_changes=data.train_blend"
    )
    new, notes = resume_data(build_data(new_cfg, PCTX), new_cfg, PCTX, _meta(old_cfg, old, consumed), consumed)
    k = 4000
    d, c = new.train.index.lookup(np.arange(consumed, consumed + k))
    ref_d, ref_c = mc_greedy(mc_blend_weights([0.5, 0.5]), k)
    assert d.tolist() == ref_d  # the new weights' greedy rule, from the change on
    assert c.tolist() == [had[x] + y for x, y in zip(ref_d, ref_c)]  # each component where it stopped
    for comp in (0, 1):  # before and after the change together: every sample of the component once, in order
        before = [cc for dd, cc in zip(old_d, old_c) if dd == comp]
        after = c[d == comp].tolist()
        assert before + after == list(range(len(before) + len(after)))
    assert new.train.sample(consumed)["tokens"].tolist() == old.train.datasets[0].sample(153_600)["tokens"].tolist()
    assert any(
        "153,600" in x and "358,400" in x and "no sample of a continuing component is skipped or replayed" in x
        for x in notes
    ), notes

    # the checkpoints after the change record the position: a later resume continues the same order
    later = 600_000
    again, notes = resume_data(build_data(new_cfg, PCTX), new_cfg, PCTX, _meta(new_cfg, new, later), later)
    assert notes == []
    assert (
        again.train.index.lookup(np.arange(later, later + 500))[1].tolist()
        == new.train.index.lookup(np.arange(later, later + 500))[1].tolist()
    )


def test_the_plan_a_run_started_with_survives_a_longer_schedule(corpus):
    """Extending train.steps on a resume changes megatron-core's plan (here from one epoch of a to two); the plan
    the run started with is recorded and kept, so the samples already ordered stay where they are."""
    from megatron_geo.training.data_setup import resume_data

    ix_a = IndexedDataset(str(corpus.root / "a"))
    per_epoch_a = (int(np.asarray(ix_a.sizes, dtype=np.int64).sum()) - 1) // S
    blend = f"data.train_blend=0.5 {corpus.root}/a 0.5 {corpus.root}/b"
    first_cfg = _cfg(corpus, blend, f"train.steps={per_epoch_a // 2}")
    first = build_data(first_cfg, PCTX)
    assert not first.train.datasets[0].two_epoch_plan
    longer_cfg = _cfg(corpus, blend, f"train.steps={per_epoch_a}", "checkpoint.allow_changes=train.steps")
    assert build_data(longer_cfg, PCTX).train.datasets[0].two_epoch_plan  # what a fresh run of it would plan
    resumed, notes = resume_data(build_data(longer_cfg, PCTX), longer_cfg, PCTX, _meta(first_cfg, first, 40), 40)
    assert not resumed.train.datasets[0].two_epoch_plan and notes == []
    assert resumed.record["train"]["planned_samples"] == first.record["train"]["planned_samples"]
    for g in range(40, 240):
        assert resumed.train.sample(g)["tokens"].tolist() == first.train.sample(g)["tokens"].tolist()


def test_a_checkpoint_without_the_rule_keeps_the_legacy_rule(corpus):
    """A checkpoint saved before the rule was recorded continues on its legacy split (and says so); one that
    records the rule keeps it."""
    from megatron_geo.training.data_setup import resume_data

    cfg = _cfg(corpus, f"data.train_prefix={corpus.root}/p286", "data.split=90,5,5", "train.steps=20")
    fresh = build_data(cfg, PCTX)
    assert fresh.rule == "megatron_core" and fresh.record["index_rule"] == "megatron_core"
    old_meta = {"config": config_to_dict(cfg), "consumed_samples": 16}  # no "data": an earlier release
    resumed, notes = resume_data(build_data(cfg, PCTX), cfg, PCTX, old_meta, 16)
    assert (resumed.train.start, resumed.train.stop) == (0, 258)  # the legacy bounds it ran with
    assert resumed.rule == "legacy" and resumed.record["index_rule"] == "legacy"
    assert any("legacy" in x for x in notes)
    again, notes = resume_data(build_data(cfg, PCTX), cfg, PCTX, _meta(cfg, resumed, 32), 32)
    assert (again.train.start, again.train.stop) == (0, 258) and again.rule == "legacy"
    assert any("ran the legacy index rule" in x for x in notes)
    kept, notes = resume_data(build_data(cfg, PCTX), cfg, PCTX, _meta(cfg, fresh, 16), 16)
    assert (kept.train.start, kept.train.stop) == (0, 257) and notes == []


def test_training_records_the_rule_and_continues_a_changed_blend(tmp_path):
    """The trainer's wiring: every checkpoint records the rule and the blend position; a checkpoint without them
    resumes under the legacy rule and records it from then on; a resume with other weights
    (``checkpoint.allow_changes=data.train_blend``) records where the new blend starts and each component's count."""
    from ckpt_helpers import tiny_train_overrides
    from ckpt_helpers import train_jobs as _train_jobs
    from dist_harness import run_distributed

    base = make_corpus(tmp_path / "data")
    keep = [o for o in base if not o.startswith(("data.train_prefix", "data.valid_prefix"))]
    a, b = tmp_path / "data/train", tmp_path / "data/valid"
    data = [*keep, f"data.train_blend=0.6 {a} 0.3 {b} 0.1 {a}", "data.split=90,10,0", "train.eval_batches=0"]
    run = tmp_path / "run"
    ckpts = run / "checkpoints"

    def meta(step):
        return json.loads((ckpts / f"step_{step:08d}" / "meta.json").read_text())

    run_distributed(_train_jobs, 1, [tiny_train_overrides(run, data, "train.steps=4", "train.exit_interval=1")])
    first = meta(1)["data"]
    assert first["index_rule"] == "megatron_core" and first["train"]["start"] == 0
    assert first["train"]["greedy_weights"] == mc_blend_weights([0.6, 0.3, 0.1])
    # as an earlier release saved it: no data record
    m1 = meta(1)
    del m1["data"]
    (ckpts / "step_00000001" / "meta.json").write_text(json.dumps(m1))
    for later in ckpts.glob("step_0000000[2-9]"):
        later.rename(tmp_path / later.name)  # resume from step 1
    (ckpts / "latest").write_text("step_00000001")
    run_distributed(_train_jobs, 1, [tiny_train_overrides(run, data, "train.steps=4", "train.exit_interval=2")])
    assert meta(2)["data"]["index_rule"] == "legacy"
    assert meta(2)["data"]["train"]["greedy_weights"] == mc_normalize([0.6, 0.3, 0.1])  # normalised once
    changed = [o if not o.startswith("data.train_blend") else f"data.train_blend=0.5 {a} 0.5 {b}" for o in data]
    allow = "checkpoint.allow_changes=data.train_blend"
    run_distributed(_train_jobs, 1, [tiny_train_overrides(run, changed, "train.steps=4", allow)])
    rec = meta(4)["data"]
    assert rec["index_rule"] == "legacy" and rec["train"]["start"] == 16  # the change came after step 2 (16 samples)
    had_d, _ = mc_greedy(mc_normalize([0.6, 0.3, 0.1]), 16)
    # the prefix a was two components (0.6 and 0.1) reading the same samples: it goes on after the further one
    assert rec["train"]["start_counts"] == [max(had_d.count(0), had_d.count(2)), had_d.count(1)]
    assert rec["train"]["prefixes"] == [str(a), str(b)]
