"""Backward hooks that accumulate gradients into the bucket buffers and start each bucket's DP reduction
as soon as all of its gradients are ready, overlapping communication with the rest of backward.

Usage per optimizer step::

    grad_sync.start_step()
    for i, mb in enumerate(micro_batches):
        grad_sync.set_last_micro_batch(i == len(micro_batches) - 1)
        loss(mb).backward()
    grad_sync.finish()     # waits for every bucket's reduction
"""

from __future__ import annotations

import torch

from ..comm.reducer import GradientReducer, PendingReduction
from .buckets import Bucket
from .early_muon import EarlyMuonUpdates


class GradSync:
    """Owns the hooks and the in-flight reductions of all buckets.

    ``sharded=True`` (distributed optimizer): reduce-scatter, each rank keeps its chunk's average.
    ``sharded=False``: all-reduce, every rank holds the whole average.
    Each bucket is reduced with the state the reducer registered for it, ``bucket.reduction``
    (:func:`~.buckets.register_buckets`; ``None``: the reducer's even chunks of an unregistered buffer).

    ``comm_stream``: run each bucket's reduction (encode, collectives, decode and FP32 sum) on a separate
    CUDA stream, all queued when the bucket is launched, so the codec kernels of low-precision reducers overlap
    the rest of backward instead of queueing behind it or waiting for :meth:`finish`. ``None`` (default) turns it on
    when the gradient buffers are on CUDA; on CPU nothing changes.
    The side stream waits for the compute stream before each launch (the bucket's gradients are
    complete), and the compute stream waits for the side stream in :meth:`finish`, so the optimizer
    sees the finished reduction; every temporary of the reducer is allocated and freed on the side stream.

    ``early_updates``: ``None``, or an :class:`~.early_muon.EarlyMuonUpdates` whose ``on_reduced(bucket)`` is
    called for each bucket once its reduction is complete (it starts the bucket's Muon updates). Without a side
    stream in :meth:`finish`, in bucket order, each right after its bucket's wait, while later buckets are still in
    flight. With the side stream (the reduction stream) at launch, on a second stream of its own (the Newton-Schulz
    stream, made when ``early_updates`` is set), so that no bucket's encode or collective is queued behind an
    earlier bucket's orthogonalisation (ProcessGroupNCCL makes a collective wait for the stream current when it is
    issued):

    - after bucket i's decode an event is recorded on the reduction stream, and the Newton-Schulz stream waits for
      it before bucket i's orthogonalisation (which reads the bucket's reduced gradients);
    - in :meth:`finish` an event is recorded on the Newton-Schulz stream after the step's last orthogonalisation,
      and the compute stream waits for it (beside its wait for the reduction stream), so the gradient norm, the
      clip's in-place scale and the optimizer step that consumes the orthogonalised updates come after it.

    Memory across the streams: the Newton-Schulz stream reads only the gradient buffers and the momentum buffers,
    which live for the whole run and are next written on the compute stream after the wait above (the next step's
    zeroing, the clip, the optimizer step); its temporaries are allocated and freed on it; the orthogonalised
    updates it leaves are allocated on it and read, then freed, on the compute stream after the wait, which
    ``MuonNS.step`` declares with ``Tensor.record_stream`` so the caching allocator does not hand their blocks to
    the Newton-Schulz stream again before the compute stream is done with them.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        reducer: GradientReducer,
        sharded: bool,
        overlap: bool = True,
        comm_stream: bool | None = None,
    ):
        self.buckets, self.reducer, self.sharded, self.overlap = buckets, reducer, sharded, overlap
        on_cuda = bool(buckets) and buckets[0].grad_data.is_cuda
        if comm_stream and not on_cuda:
            raise ValueError("comm_stream=True needs gradient buffers on a CUDA device; use comm_stream=None or False")
        self._stream = (
            torch.cuda.Stream(device=buckets[0].grad_data.device)
            if (on_cuda if comm_stream is None else comm_stream)
            else None
        )
        self._pending: dict[int, PendingReduction] = {}
        self._remaining: dict[int, int] = {}
        self._ready: set[int] = set()
        self._next = 0  # position in self.buckets of the next bucket to launch
        self._last = True
        self._defer = False
        self._handles = []
        self._early: EarlyMuonUpdates | None = None
        self._ns_stream: torch.cuda.Stream | None = None  # the early Newton-Schulz stream (with the side stream)
        self._ns_queued = False  # orthogonalisations queued on it since the compute stream last waited for it
        for b in buckets:
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(b)))

    @property
    def early_updates(self) -> EarlyMuonUpdates | None:
        """The per-bucket early Muon updates, or ``None`` (see the class docstring)."""
        return self._early

    @early_updates.setter
    def early_updates(self, early: EarlyMuonUpdates | None) -> None:
        self._early = early
        if early is not None and self._stream is not None and self._ns_stream is None:
            self._ns_stream = torch.cuda.Stream(device=self._stream.device)

    def _make_hook(self, bucket: Bucket):
        def hook(p: torch.nn.Parameter) -> None:
            p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
            p.grad = None
            if self._last and self.overlap and not self._defer:
                self._remaining[bucket.index] -= 1
                if self._remaining[bucket.index] == 0:
                    self._ready.add(bucket.index)
                    self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        """Launch buckets strictly in bucket order, each once it and all before it are ready.

        Collectives are matched by call order across ranks, so every rank must launch the same buckets in
        the same order: a parameter that gets no gradient on one rank only (unused in its forward) keeps its
        bucket, and every later one, for :meth:`finish` on that rank, which then launches them in order too.
        Buckets are numbered by when their last gradient arrives in backward, so normally nothing waits.
        """
        while self._next < len(self.buckets) and self.buckets[self._next].index in self._ready:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        """Queue ``bucket``'s reduction: inline without a side stream; with one, encode, collectives, decode and sum
        on the reduction stream (after it waits for the compute stream) and then the bucket's early Muon updates on
        the Newton-Schulz stream, behind an event recorded on the reduction stream after the decode."""
        op = self.reducer.reduce_scatter if self.sharded else self.reducer.all_reduce
        if self._stream is None:
            self._pending[bucket.index] = op(bucket.grad_data, bucket.reduction, async_op=True)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            pending = op(bucket.grad_data, bucket.reduction, async_op=True)
            # NCCL's wait() only makes this stream wait for the collective (no host wait), so the bucket's
            # decode and FP32 sum are queued right behind it and overlap the rest of backward
            pending.wait()
            self._pending[bucket.index] = pending
        early = self._early
        if early is not None and early.has_work(bucket):
            assert self._ns_stream is not None  # made when early_updates was set
            decoded = torch.cuda.Event()
            decoded.record(self._stream)
            self._ns_stream.wait_event(decoded)
            with torch.cuda.stream(self._ns_stream):
                early.on_reduced(bucket)
            self._ns_queued = True

    def start_step(self, defer: bool = False) -> None:
        """Zero the FP32 gradient buffers and re-arm the readiness counters.

        ``defer=True`` launches no reduction during backward (all start in :meth:`finish`), e.g. on a
        GeoFP8 refresh step whose new transform is built after backward.
        """
        self._defer = defer
        for b in self.buckets:
            b.grad_data.zero_()
        self._pending.clear()
        self._remaining = {b.index: len(b.params) for b in self.buckets}
        self._ready.clear()
        self._next = 0
        self._last = True

    def set_last_micro_batch(self, last: bool) -> None:
        """Reductions start only during the backward of the last micro-batch of the step."""
        self._last = last

    def finish(self) -> None:
        """Launch the buckets not launched yet (unused parameters, overlap off) in bucket order, then wait all.

        With the side stream the host does not wait: the compute stream waits for the reduction stream and, when
        early Muon updates were queued this step, for an event recorded on the Newton-Schulz stream after the last
        of them."""
        for b in self.buckets[self._next :]:
            self._launch(b)
        self._next = len(self.buckets)
        if self._stream is None:
            for b in self.buckets:
                self._pending[b.index].wait()
                if self.early_updates is not None:
                    self.early_updates.on_reduced(b)
        else:
            compute = torch.cuda.current_stream(self._stream.device)
            with torch.cuda.stream(self._stream):
                for b in self.buckets:
                    self._pending[b.index].wait()
            compute.wait_stream(self._stream)
            if self._ns_queued:
                assert self._ns_stream is not None
                orthogonalised = torch.cuda.Event()
                orthogonalised.record(self._ns_stream)
                compute.wait_event(orthogonalised)
                self._ns_queued = False
        self._pending.clear()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
