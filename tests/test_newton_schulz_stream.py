"""Which CUDA stream each op of a training step is queued on, with early Muon updates (``optimizer.muon_overlap``).

On CUDA the gradient sync queues each bucket's encode, collectives and decode on its reduction stream, and
ProcessGroupNCCL makes a collective wait for the stream that is current when it is issued. Any work queued on the
reduction stream between two buckets therefore holds up every later bucket's collective. The early Newton-Schulz of
a bucket's owned Muon matrices must run on a stream of its own, ordered by events: that stream waits on an event
recorded on the reduction stream after the bucket's decode, and the compute stream waits on an event recorded on
that stream after the step's last orthogonalisation, before anything reads or writes what it used.

A CPU build has no streams, so the CUDA stream API is replaced by recording stand-ins (:class:`RecordingStream`,
:class:`RecordingEvent`) inside each gloo worker, and ``GradSync`` is given a reduction stream as it would be on
CUDA. A dispatch mode records, for every aten or c10d op, the stream current when it was queued and what it was
part of: a bucket's encode and collectives (inside the reducer's call), its decode (the pending reduction's wait),
its early Newton-Schulz (``EarlyMuonUpdates.on_reduced``) or the optimizer step (``MuonNS.step``); event records
and waits are logged in the same sequence. Two real train steps of the tiny Llama, Muon with early updates, FP8
wire, distributed optimizer, DP = 2 (gloo), no clipping. Ops run eagerly on CPU, so the values are those of any
CPU run.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest

from dist_harness import run_distributed

STEPS = 2


def _record_steps(rank: int, world: int) -> dict:
    """Train STEPS steps under the recording streams; returns the log, the stream names and the early hits."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import megatron_geo.training.setup as setup_mod
    from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg
    from megatron_geo.distributed import GradSync
    from megatron_geo.distributed.early_muon import EarlyMuonUpdates
    from megatron_geo.optim import MuonNS
    from megatron_geo.training.step import StepContext, train_step

    # ("op", name, stream, label, bucket), ("record" | "wait", stream, event id), ("step" | "finished", ...)
    log: list[tuple] = []
    names = itertools.count()
    events = itertools.count()
    label: list[tuple[str, int | None]] = [("other", None)]

    class RecordingStream:
        """``torch.cuda.Stream`` stand-in: a name; event records and waits are logged."""

        def __init__(self, device=None, priority: int = 0, name: str | None = None):
            self.device = torch.device("cpu") if device is None else torch.device(device)
            self.name = name or f"stream{next(names)}"

        def wait_event(self, event) -> None:
            log.append(("wait", self.name, event.id))

        def record_event(self, event=None):
            event = RecordingEvent() if event is None else event
            event.record(self)
            return event

        def wait_stream(self, stream) -> None:  # as torch's: record an event on ``stream``, wait for it here
            self.wait_event(stream.record_event())

    class RecordingEvent:
        """``torch.cuda.Event`` stand-in."""

        def __init__(self, **kwargs):
            self.id = next(events)

        def record(self, stream=None) -> None:
            log.append(("record", (stream or current[-1]).name, self.id))

        def wait(self, stream=None) -> None:
            (stream or current[-1]).wait_event(self)

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

    compute = RecordingStream(name="compute")
    current = [compute]

    @contextlib.contextmanager
    def stream(s):
        if s is None:
            yield
            return
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    torch.cuda.Stream = RecordingStream  # a worker process of its own: nothing to restore
    torch.cuda.Event = RecordingEvent
    torch.cuda.current_stream = lambda device=None: current[-1]
    torch.cuda.stream = stream

    class SideStreamGradSync(GradSync):
        """``GradSync`` as on CUDA: a reduction stream, although the gradient buffers are on the CPU."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._stream = torch.cuda.Stream(device=self.buckets[0].grad_data.device)

    setup_mod.GradSync = SideStreamGradSync

    @contextlib.contextmanager
    def labelled(kind: str, bucket: int | None):
        label.append((kind, bucket))
        try:
            yield
        finally:
            label.pop()

    def wrap(fn, kind: str, bucket_of):
        def wrapper(*args, **kwargs):
            with labelled(kind, bucket_of(args, kwargs)):
                return fn(*args, **kwargs)

        return wrapper

    on_reduced, step, finish = EarlyMuonUpdates.on_reduced, MuonNS.step, GradSync.finish
    EarlyMuonUpdates.on_reduced = wrap(on_reduced, "ns", lambda a, k: a[1].index)
    MuonNS.step = wrap(step, "step", lambda a, k: None)

    def finish_marked(self):
        finish(self)
        log.append(("finished", "compute", None))

    GradSync.finish = finish_marked

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind, bucket = label[-1]
            log.append(("op", func._schema.name, current[-1].name, kind, bucket))
            return func(*args, **(kwargs or {}))

    cfg = tiny_cfg("optimizer.name=muon", "optimizer.muon_overlap=true", "optimizer.clip_grad=0", "comm.dtype=fp8_e4m3")
    pctx = pctx_for()
    model, _buckets, reducer, grad_sync, opt = setup_mod.build_model_and_optimizer(cfg, pctx)
    assert grad_sync._stream is not None and grad_sync.early_updates is not None

    def launch(op):
        def call(buf, bucket=None, async_op=True):
            with labelled("encode", bucket.key):
                pending = op(buf, bucket, async_op=async_op)
            pending.wait = wrap(pending.wait, "decode", lambda a, k: bucket.key)
            return pending

        return call

    reducer.reduce_scatter = launch(reducer.reduce_scatter)
    reducer.all_reduce = launch(reducer.all_reduce)
    ctx = StepContext(model, grad_sync, opt, pctx, 0.0, autocast_dtype="none")
    with Recorder():
        for s in range(STEPS):
            log.append(("step", "compute", s))
            mbs = rank_micro_batches(global_batch(cfg, s), cfg.train.micro_batch_size, pctx.dp_rank, pctx.dp_size)
            train_step(ctx, s, mbs)
    grad_sync.remove_hooks()
    return {
        "log": log,
        "compute": compute.name,
        "reduction": grad_sync._stream.name,
        "hits": grad_sync.early_updates.hits,
    }


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_record_steps, 2)


def _steps(run: dict) -> list[list[tuple]]:
    """The log of each step, from its ``step`` entry to the next."""
    log = run["log"]
    starts = [i for i, e in enumerate(log) if e[0] == "step"]
    assert len(starts) == STEPS
    return [log[a:b] for a, b in zip(starts, starts[1:] + [len(log)])]


def _ns_streams(run: dict) -> set[str]:
    """The streams the Newton-Schulz ops were queued on."""
    return {e[2] for e in run["log"] if e[0] == "op" and e[3] == "ns"}


def _ns_stream(run: dict) -> str:
    """The one stream every Newton-Schulz op was queued on."""
    streams = _ns_streams(run)
    assert len(streams) == 1, f"Newton-Schulz ops on {len(streams)} streams: {sorted(streams)}"
    return streams.pop()


def test_every_step_orthogonalises_early_and_uses_the_result(runs):
    """The precondition of the other tests: Newton-Schulz ran per bucket in backward, and the step used it."""
    for rank, run in enumerate(runs):
        for k, ev in enumerate(_steps(run)):
            ns_buckets = {e[4] for e in ev if e[0] == "op" and e[3] == "ns"}
            assert len(ns_buckets) >= 2, (rank, k, ns_buckets)
        assert run["hits"] > 0, (rank, run["hits"])


def test_no_encode_or_collective_is_queued_behind_an_earlier_buckets_newton_schulz(runs):
    """Every bucket's encode and collectives are queued on the reduction stream, and no Newton-Schulz op of an
    earlier bucket is queued before them on that stream."""
    for rank, run in enumerate(runs):
        for k, ev in enumerate(_steps(run)):
            launches = [e for e in ev if e[0] == "op" and e[3] == "encode"]
            assert launches and any(e[1].startswith("c10d::") for e in launches), (rank, k)
            elsewhere = sorted({(e[1], e[2]) for e in launches if e[2] != run["reduction"]})
            assert elsewhere == [], f"rank {rank}, step {k}: encode / collective ops off the reduction stream"
            queue = [e for e in ev if e[0] == "op" and e[2] == run["reduction"]]
            behind = []
            for i, e in enumerate(queue):
                if e[3] != "encode":
                    continue
                earlier = {q[4] for q in queue[:i] if q[3] == "ns" and q[4] != e[4]}
                if earlier:
                    behind.append((e[1], e[4], sorted(earlier)))
            collectives = [b for b in behind if b[0].startswith("c10d::")]
            assert behind == [], (
                f"rank {rank}, step {k}: {len(collectives)} collectives and {len(behind) - len(collectives)} "
                f"encode ops queued on the reduction stream behind an earlier bucket's Newton-Schulz, e.g. "
                f"{collectives[:3] or behind[:3]} (op, bucket, Newton-Schulz of buckets)"
            )


def test_newton_schulz_runs_on_a_stream_of_its_own(runs):
    for rank, run in enumerate(runs):
        ns = _ns_stream(run)
        assert ns not in (run["compute"], run["reduction"]), (rank, ns, run["compute"], run["reduction"])


def test_newton_schulz_waits_for_an_event_recorded_after_its_buckets_decode(runs):
    """Before a bucket's first Newton-Schulz op, its stream waits for an event recorded on the reduction stream
    after the bucket's last decode op."""
    for rank, run in enumerate(runs):
        ns = _ns_stream(run)
        for k, ev in enumerate(_steps(run)):
            recorded = {e[2]: (i, e[1]) for i, e in enumerate(ev) if e[0] == "record"}
            firsts: dict[int, int] = {}
            for i, e in enumerate(ev):
                if e[0] == "op" and e[3] == "ns":
                    firsts.setdefault(e[4], i)
            for bucket, first in firsts.items():
                decodes = [i for i, e in enumerate(ev[:first]) if e[0] == "op" and e[3] == "decode" and e[4] == bucket]
                assert decodes, (rank, k, bucket, "Newton-Schulz before the bucket's decode")
                ok = [
                    e[2]
                    for i, e in enumerate(ev[:first])
                    if e[0] == "wait"
                    and e[1] == ns
                    and e[2] in recorded
                    and recorded[e[2]][1] == run["reduction"]
                    and decodes[-1] < recorded[e[2]][0] < first
                ]
                assert ok, (
                    f"rank {rank}, step {k}, bucket {bucket}: the Newton-Schulz stream {ns} waits for no event "
                    f"recorded on the reduction stream after the bucket's decode"
                )


def test_compute_stream_waits_for_the_newton_schulz_stream_before_the_optimizer_step(runs):
    """The compute stream waits for an event recorded on the Newton-Schulz stream after the step's last
    orthogonalisation, within ``GradSync.finish``: before the gradient norm and the clip (which read and scale the
    gradients the orthogonalisation read) and the optimizer step (which consumes its result)."""
    for rank, run in enumerate(runs):
        ns = _ns_stream(run)
        for k, ev in enumerate(_steps(run)):
            last_ns = max(i for i, e in enumerate(ev) if e[0] == "op" and e[3] == "ns")
            first_step = min(i for i, e in enumerate(ev) if e[0] == "op" and e[3] == "step")
            assert all(e[2] == run["compute"] for e in ev if e[0] == "op" and e[3] == "step"), (rank, k)
            after = {e[2]: i for i, e in enumerate(ev) if e[0] == "record" and e[1] == ns and i > last_ns}
            waits = [i for i, e in enumerate(ev) if e[0] == "wait" and e[1] == run["compute"] and e[2] in after]
            assert waits, f"rank {rank}, step {k}: the compute stream never waits for the Newton-Schulz stream"
            finished = [i for i, e in enumerate(ev) if e[0] == "finished"]
            assert len(finished) == 1 and waits[0] < finished[0], (rank, k, waits[0], finished)
            assert waits[0] < first_step, (rank, k, waits[0], first_step)
