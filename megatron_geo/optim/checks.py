"""Start-up checks of the ``optimizer`` section: its cross-key rules and its keys that the other settings give no
effect. ``optimizer.muon_ns_dtype`` (:func:`.muon.newton_schulz_dtype`) and ``optimizer.muon_split``
(``distributed/split_plan.py``) are parsed by their own functions."""

from __future__ import annotations

import math

from ..config.checks import InertRule
from ..config.errors import ConfigError
from ..config.schema import OptimizerConfig

_MUON_KEYS = (
    "optimizer.muon_momentum",
    "optimizer.muon_adjust_lr_fn",
    "optimizer.muon_ns_dtype",
    "optimizer.muon_ns",
    "optimizer.muon_overlap",
    "optimizer.muon_split",
    "optimizer.adamw_lr",
)


def check_optimizer_config(o: OptimizerConfig, tensor: int) -> None:
    """Check the ``optimizer`` keys, with ``tensor`` the tensor-parallel size.

    Checked: ``lr`` positive and finite; ``0 <= min_lr <= lr``; ``beta1``, ``beta2`` and ``muon_momentum`` in
    ``[0, 1)``; ``weight_decay`` and ``clip_grad`` finite and ``>= 0``; ``eps > 0``; ``name=muon`` only with
    ``tensor == 1`` (Muon orthogonalises whole matrices).

    Raises:
        ConfigError: naming the key, the bad value and the fix.
    """
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise ConfigError(f"optimizer.lr={o.lr} must be a positive finite number")
    if not (math.isfinite(o.min_lr) and 0 <= o.min_lr <= o.lr):
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr}")
    for name, v in (("beta1", o.beta1), ("beta2", o.beta2), ("muon_momentum", o.muon_momentum)):
        if not 0 <= v < 1:
            raise ConfigError(f"optimizer.{name}={v} must be in [0, 1)")
    for name, v in (("weight_decay", o.weight_decay), ("clip_grad", o.clip_grad)):
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"optimizer.{name}={v} must be >= 0 (clip_grad=0 turns clipping off)")
    if not o.eps > 0:
        raise ConfigError(f"optimizer.eps={o.eps} must be > 0")
    if o.name == "muon" and tensor > 1:
        raise ConfigError(
            "optimizer.name=muon with parallel.tensor>1 is not supported: Muon orthogonalizes whole matrices and this "
            "release does not gather TP shards for it. Use parallel.tensor=1 with muon, or optimizer.name=adamw with TP"
        )


def optimizer_inert_keys(o: OptimizerConfig, distributed_optimizer: bool) -> list[InertRule]:
    """The ``optimizer`` keys that the settings give no effect: the Muon keys and ``adamw_lr`` with
    ``name=adamw``; ``muon_split`` under Muon without the distributed optimizer (``distributed_optimizer``:
    ``parallel.distributed_optimizer``)."""
    rules: list[InertRule] = []
    if o.name == "adamw":
        rules.append((_MUON_KEYS, "optimizer.name=adamw", "set optimizer.name=muon"))
    if not distributed_optimizer and o.name == "muon":
        rules.append(
            (
                ("optimizer.muon_split",),
                "parallel.distributed_optimizer=false (every rank orthogonalises every matrix whole)",
                "set parallel.distributed_optimizer=true",
            )
        )
    return rules
