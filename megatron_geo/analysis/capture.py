"""One capture of a layer set's per-rank gradients and K-FAC factors, the unit every fidelity row is
evaluated on (from the model, :mod:`.model_capture`, or a synthetic scenario, :mod:`.scenarios`).

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Capture:
    """Per-rank gradients and the K-FAC factors of the same micro-batches (or synthetic tokens).

    Attributes:
        step: training step of the capture (0 for a scenario).
        names: layer (weight) names, in order.
        grads: ``{name: [R float32 [d_out, d_in] gradients]}``, one per simulated DP rank.
        loss: mean loss over the ranks (nats; None for a scenario).
        A: ``{name: float32 [d_in, d_in]}`` = sum over all ranks' tokens of ``a a^T`` / token count (the
            DP-averaged input factor the trainer eigendecomposes).
        S_hooks: ``{name: float32 [d_out, d_out]}`` output factor from backward hooks, or None.
        seconds: wall time of the capture.
        params: the generating parameters (scenarios), JSON-ready.
    """

    step: int
    names: list
    grads: dict
    loss: float | None
    A: dict
    S_hooks: dict | None
    seconds: float
    params: dict = field(default_factory=dict)
