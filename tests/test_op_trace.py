"""The op recorder's memory-traffic figures (used by benchmarks/codec.py), on ops whose bytes are known."""

from __future__ import annotations

import torch

from megatron_geo.comm.op_trace import OpRecorder


def test_traffic_counts_each_ops_inputs_and_outputs_and_fused_regions_only_their_boundary():
    x = torch.randn(1000)
    rec = OpRecorder()

    def step(a):  # mul (4000 in + 4000 out), add (4000 + 4000), sum (4000 + 4)
        return (a * 2 + 1).sum()

    with rec:
        torch.empty(10_000)  # an allocation moves no bytes
        s = rec.fused(step)(x)
        y = x.neg()  # outside any region: 4000 + 4000
        rec.collective(lambda: y.zero_())()  # the collective's own data movement: not fused traffic
    assert s.item() == (x * 2 + 1).sum().item()
    assert rec.traffic_bytes == 16000 + 4004 + 8000 + 8000
    assert rec.fused_traffic_bytes == 4000 + 4 + 8000
    assert rec.work == 6 and rec.bad == []  # empty, mul, add, sum, neg, zero_


def test_a_mutated_argument_returned_by_a_fused_step_counts_once():
    x, out = torch.randn(256), torch.empty(256)
    rec = OpRecorder()
    with rec:
        rec.fused(lambda a, o: o.copy_(a * 3))(x, out)
    assert torch.equal(out, x * 3)
    assert rec.fused_traffic_bytes == 2 * 256 * 4
