"""LR schedule table and the shard plan's ownership invariants."""

import math
import random

import pytest

from megatron_geo.distributed.shard_plan import plan_shards
from megatron_geo.optim.schedule import lr_at


def test_lr_schedule_table():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    table = [lr_at(s, **kw) for s in range(16)]
    assert table[:4] == [0.25, 0.5, 0.75, 1.0]  # warmup starts above zero, reaches the peak
    assert table[4] == 1.0 and math.isclose(table[13], 0.1) and table[15] == pytest.approx(0.1)
    mid = 4 + (13 - 4) / 2  # cosine midpoint
    assert math.isclose(lr_at(int(mid * 2) // 2, **kw), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert all(a >= b for a, b in zip(table[4:], table[5:]))
    # no division by zero: no warmup, one step, warmup longer than training
    assert lr_at(0, max_lr=1.0, min_lr=0.1, warmup_steps=0, total_steps=1) == pytest.approx(0.1)
    assert lr_at(0, max_lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=5) == pytest.approx(0.1)
    assert lr_at(3, max_lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=7, style="linear") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="decay style"):
        lr_at(5, max_lr=1.0, min_lr=0.1, warmup_steps=0, total_steps=10, style="exp")


def test_shard_plan_covers_each_element_once():
    for trial in range(500):
        rnd = random.Random(trial)
        k, dp, align = rnd.randint(1, 12), rnd.randint(1, 5), rnd.choice([1, 4, 16])
        numels = [rnd.choice([0, 1, 3, 7, 64, 100, 1000]) for _ in range(k)]
        atomic = [rnd.random() < 0.5 for _ in range(k)]
        plan = plan_shards(numels, atomic, dp, align)
        assert plan.chunk % align == 0
        assert all(off % align == 0 for off in plan.offsets)  # no codec block spans two parameters
        cover = [0] * plan.buffer_numel
        owned = [0] * k
        for r, pieces in enumerate(plan.pieces):
            for pc in pieces:
                assert r * plan.chunk <= pc.buffer_start and pc.buffer_start + pc.numel <= (r + 1) * plan.chunk
                assert pc.buffer_start == plan.offsets[pc.index] + pc.param_start  # contiguous parameter
                if atomic[pc.index]:
                    assert (pc.param_start, pc.param_end) == (0, numels[pc.index])
                for j in range(pc.numel):
                    cover[pc.buffer_start + j] += 1
                owned[pc.index] += pc.numel
        assert max(cover, default=0) <= 1 and owned == numels


def test_shard_plan_padding_is_small_for_splittable_params():
    plan = plan_shards([1000, 10, 10, 3], [False] * 4, 3)
    assert plan.chunk == math.ceil(1023 / 3) and plan.padding([1000, 10, 10, 3]) <= 2


def test_ownership_rule_per_parameter():
    """param_specs: Muon matrices atomic under the distributed optimizer (Newton-Schulz FLOPs, 5 iterations of
    4 k^2 K + 2 k^3), GeoFP8 rows cut at lcm(row, alignment), AdamW 12 FLOPs per element, nothing atomic or
    granular without the distributed optimizer."""
    from megatron_geo.config import load_config
    from megatron_geo.distributed.ownership import param_specs

    infos = [("a.weight", (24, 40), True), ("b.weight", (40, 24), True), ("norm.weight", (40,), False)]
    cfg = load_config([], ["optimizer.name=muon"])
    a, b, n = param_specs(cfg, infos, 16, geo_layers={"b.weight"})
    assert (a.numel, a.atomic, a.granule, a.flops) == (960, True, 1, 5 * (4 * 24**2 * 40 + 2 * 24**3))
    assert (b.atomic, b.granule) == (True, 48)  # a GeoFP8 layer under Muon: atomic anyway
    assert (n.numel, n.atomic, n.granule, n.flops) == (40, False, 1, 12.0 * 40)
    adamw = load_config([], ["optimizer.name=adamw"])
    a, b, n = param_specs(adamw, infos, 16, geo_layers={"b.weight"})
    assert (a.atomic, a.flops) == (False, 12.0 * 960) and (b.atomic, b.granule) == (False, 48)  # lcm(24, 16)
    assert param_specs(adamw, infos, 1, geo_layers={"b.weight"})[1].granule == 24
    flat = load_config([], ["optimizer.name=muon", "parallel.distributed_optimizer=false"])
    assert all(not s.atomic and s.granule == 1 for s in param_specs(flat, infos, 16, geo_layers={"b.weight"}))
    with pytest.raises(ValueError, match="alignment"):
        param_specs(cfg, infos, 0)
