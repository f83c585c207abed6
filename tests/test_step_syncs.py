"""What waits on what in the whole training loop, recorded op by op (not only the codecs).

``train()`` of the tiny model with Muon (whole-matrix owners, uneven ranges) and the distributed optimizer, with
``parallel.overlap_param_gather=true``, runs under :class:`~megatron_geo.comm.op_trace.OpRecorder` with markers at
each step, around ``publish()`` (where the asynchronous parameter all-gathers start) and at every
``wait_param_gather()`` from outside ``publish()``. On a GPU a DP collective issued after the gathers queues
behind them on the NCCL stream, and a host read then waits for all of them; so for every step after the first:

- no collective runs between the end of ``publish()`` and the first forward wait of the next step;
- outside log steps, at most one op forces a host synchronisation (the gradient norm: the skip / clip decision),
  and none runs inside backward (the reduction hooks).

Host reads inside torch's single-tensor AdamW (its CPU step counter) are left out: on CUDA the optimizer is built
with ``fused=True`` (``DistributedOptimizer._build_optimizers``), which reads nothing on the host; so are the data
pipeline's host tensors (the batch is built on the host and copied to the device without blocking).
Run at DP = 2 (gloo, two processes) and DP = 64 (rank 0 on torch's fake process group).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 5
# host-side reads that are no device sync on a GPU either: torch's single-tensor AdamW reading its CPU step counter
# (CPU only: on CUDA the optimizer is fused), and the data pipeline building the batch as host tensors (copied to
# the device with non_blocking=True in the step)
HOST_ONLY = ("torch.optim.optimizer:_get_value", "at megatron_geo.data.")


def record_training(run_dir: str, dp: int) -> dict:
    """Train STEPS steps under the recorder; returns the event list (kind, name, in_backward)."""
    from helpers import pctx_for, tiny_cfg
    from megatron_geo.comm.op_trace import OpRecorder
    from megatron_geo.distributed.optimizer import DistributedOptimizer
    from megatron_geo.training import step as step_mod
    from megatron_geo.training import trainer

    cfg = tiny_cfg(
        "optimizer.name=muon",
        "parallel.overlap_param_gather=true",
        f"train.steps={STEPS}",
        "train.log_interval=1000",
        "train.eval_batches=0",
        "checkpoint.interval=0",
        "checkpoint.save_at_end=false",
        "train.progress=false",
        f"train.run_dir={run_dir}",
        f"train.global_batch_size={max(8, 2 * dp)}",
    )
    rec = OpRecorder(keep_events=True)
    publish, wait, train_step = (
        DistributedOptimizer.publish,
        DistributedOptimizer.wait_param_gather,
        step_mod.train_step,
    )
    inside = {"publish": False}

    def publish_marked(self):
        rec.mark("publish")
        inside["publish"] = True
        try:
            publish(self)
        finally:
            inside["publish"] = False
        rec.mark("published")

    def wait_marked(self, bucket_indices=None):
        if not inside["publish"]:
            rec.mark("wait")
        return wait(self, bucket_indices)

    def step_marked(*args, **kwargs):
        rec.mark("step")
        return train_step(*args, **kwargs)

    DistributedOptimizer.publish, DistributedOptimizer.wait_param_gather = publish_marked, wait_marked
    trainer.train_step = step_marked
    try:
        pctx = pctx_for(1)
        with rec:
            trainer.train(cfg, pctx)
    finally:
        DistributedOptimizer.publish, DistributedOptimizer.wait_param_gather = publish, wait
        trainer.train_step = train_step
    return {"events": rec.events}


def _dp2(rank, world, run_dir):
    return record_training(run_dir, world)


def _fake64(run_dir: str) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    try:
        return record_training(run_dir, 64)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dist_harness import run_distributed

    out = {"DP=2 rank 0": None, "DP=2 rank 1": None}
    dp2 = run_distributed(_dp2, 2, str(tmp_path_factory.mktemp("dp2")))
    out["DP=2 rank 0"], out["DP=2 rank 1"] = dp2[0], dp2[1]
    r = subprocess.run(
        [sys.executable, __file__, str(tmp_path_factory.mktemp("dp64"))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out["DP=64 (fake) rank 0"] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def split_steps(events: list) -> list[list]:
    """The events of each step: from a ``step`` marker to the next (the last one to the end of training)."""
    starts = [i for i, e in enumerate(events) if e[0] == "mark" and e[1] == "step"]
    assert len(starts) == STEPS, f"expected {STEPS} step markers, got {len(starts)}"
    return [events[a:b] for a, b in zip(starts, starts[1:] + [len(events)])]


def test_no_collective_between_publish_and_the_first_forward_wait(runs):
    for where, run in runs.items():
        ev = [tuple(e) for e in run["events"]]
        ends = [i for i, e in enumerate(ev) if e == ("mark", "published", False)]
        assert len(ends) == STEPS, (where, len(ends))
        for k, end in enumerate(ends[:-1]):  # the last publish is followed by the end of training
            nxt = next(i for i in range(end + 1, len(ev)) if ev[i][0] == "mark" and ev[i][1] == "wait")
            between = [e[1] for e in ev[end + 1 : nxt] if e[0] == "c10d"]
            assert between == [], f"{where}, after step {k + 1}: collectives before the first forward wait: {between}"
            assert any(e == ("mark", "step", False) for e in ev[end + 1 : nxt]), (
                where,
                k,
            )  # the wait is the next step's


def test_at_most_one_host_sync_per_step_outside_log_steps_and_none_in_backward(runs):
    for where, run in runs.items():
        steps = split_steps([tuple(e) for e in run["events"]])
        for k, ev in enumerate(steps):
            syncs = [(name, bwd) for kind, name, bwd in ev if kind == "sync"]
            assert not [s for s in syncs if s[1]], f"{where}, step {k + 1}: host syncs inside backward: {syncs}"
            if k in (0, STEPS - 1):
                continue  # the first and the last step are log steps (the loss is read)
            ours = [n for n, _ in syncs if not any(h in n for h in HOST_ONLY)]
            assert len(ours) <= 1, f"{where}, step {k + 1}: {len(ours)} host syncs: {ours}"
            assert all("grad_norm" in n for n in ours), (where, k, ours)


if __name__ == "__main__":
    print(json.dumps(_fake64(sys.argv[1])))
