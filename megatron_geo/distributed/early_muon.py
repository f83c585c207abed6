"""Muon updates started per bucket: each owned Muon matrix is orthogonalised as soon as its bucket's DP reduction
has finished, instead of after the whole backward.

Newton-Schulz is the bulk of a Muon step (``docs/bench/newton_schulz_cpu.json``), and in the plain order it runs
only in ``optimizer.step()``, after the last bucket's reduction, while the network sits idle. Here
:meth:`EarlyMuonUpdates.on_reduced` is called by :class:`~.data_parallel.GradSync` for each bucket once its reduction
is complete:

- on CUDA on a stream of its own (the Newton-Schulz stream, owned by the gradient sync), which waits for an event
  recorded on the gradient sync's reduction stream after the bucket's decode, so the orthogonalisation runs beside
  the rest of backward and no later bucket's encode or collective is queued behind it; the compute stream waits for
  an event recorded on the Newton-Schulz stream after the step's last orthogonalisation before the gradient norm,
  the clip and the optimizer step (:class:`~.data_parallel.GradSync`, which also says how memory is kept safe
  across the streams);
- on CPU in :meth:`~.data_parallel.GradSync.finish`, bucket by bucket, while the reductions of later buckets are
  still in flight.

Clipping is what makes this speculative: the update depends on the clipped gradient, and the clip factor needs the
global norm of every bucket. The precomputed update assumes no clipping; :meth:`EarlyMuonUpdates.observe` (called
with the step's norm before the clip) discards the precomputed updates when the step clips or is skipped, and
:class:`~megatron_geo.optim.muon.MuonNS` uses a precomputed update only when the gradient and momentum buffer are
still the tensors and versions it was computed from. Either way the step's values are bitwise those of the plain
order. A step that clips pays Newton-Schulz twice, so after a clipped step the next one does not speculate (its norm
is likely above the threshold too); ``hits`` / ``misses`` say how often the speculation paid.
"""

from __future__ import annotations

import math

from .buckets import Bucket


class EarlyMuonUpdates:
    """Per-bucket early orthogonalisation for the Muon optimizers of a distributed optimizer.

    Args:
        optimizer: the :class:`~.optimizer.DistributedOptimizer`; every main param whose torch optimizer has a
            ``precompute`` method (:class:`~megatron_geo.optim.muon.MuonNS`) takes part, grouped by its bucket.
            Other Muon implementations (torch's own ``Muon``, a split update) keep the plain order.
    """

    def __init__(self, optimizer):
        self._by_bucket: dict[int, list] = {}  # bucket index -> [(torch optimizer, [main tensors])]
        self._optimizers = []
        for m in optimizer.mains:
            opt = optimizer.optimizer_of(m)
            if not callable(getattr(opt, "precompute", None)) or not m.whole:
                continue
            if opt not in self._optimizers:
                self._optimizers.append(opt)
            entries = self._by_bucket.setdefault(m.bucket.index, [])
            for o, mains in entries:
                if o is opt:
                    mains.append(m.main)
                    break
            else:
                entries.append((opt, [m.main]))
        self.speculate = True  # cleared after a step that clipped

    @property
    def active(self) -> bool:
        """True when some owned Muon matrix takes part."""
        return bool(self._by_bucket)

    def has_work(self, bucket: Bucket) -> bool:
        """True when :meth:`on_reduced` would orthogonalise something for ``bucket`` (it holds owned Muon matrices
        and this step speculates): the gradient sync orders streams for such buckets only."""
        return self.speculate and bool(self._by_bucket.get(bucket.index))

    def on_reduced(self, bucket: Bucket) -> None:
        """Orthogonalise the owned Muon matrices of ``bucket`` (its reduction is complete), queued on the current
        stream (the caller chooses it: the Newton-Schulz stream on CUDA with a side stream)."""
        if not self.speculate:
            return
        for opt, mains in self._by_bucket.get(bucket.index, ()):
            opt.precompute(mains)

    def observe(self, norm: float, clip_grad: float) -> None:
        """The step's global gradient norm, before clipping: drop the precomputed updates when the gradient is
        about to be scaled (``clip_grad > 0`` and ``norm > clip_grad``) or the step is skipped (non-finite norm),
        and speculate on the next step only if this one did not clip."""
        clips = not math.isfinite(norm) or (clip_grad > 0 and norm > clip_grad)
        if clips:
            for opt in self._optimizers:
                opt.discard_precomputed()
        self.speculate = not (math.isfinite(norm) and clip_grad > 0 and norm > clip_grad)

    @property
    def hits(self) -> int:
        """Matrices whose update came from an early orthogonalisation, since the start."""
        return sum(o.precompute_hits for o in self._optimizers)

    @property
    def misses(self) -> int:
        """Early orthogonalisations discarded (the step clipped or was skipped), since the start."""
        return sum(o.precompute_misses for o in self._optimizers)
