"""Optional torch.compile of each transformer block (``train.compile=true``).

Compiling per block instead of the whole model keeps compile time short (every block has the same code,
so one graph is reused by all of them), keeps the backward hooks of the gradient buckets outside the
compiled graphs (they fire per parameter as in eager mode), and keeps parameter names unchanged: the
blocks are compiled in place with ``nn.Module.compile``, so ``model.layers.3.mlp.down_proj.weight`` stays
what GeoFP8 layer patterns, checkpoints and the shard plan see.

GeoFP8 registers forward pre-hooks on its layers on refresh steps only; a compiled block then runs the
hooked module in a separate graph (one recompile the first time), which is correct but not free.
"""

from __future__ import annotations

from torch import nn


def compile_blocks(model: nn.Module, backend: str = "inductor", mode: str | None = None,
                   dynamic: bool | None = False) -> int:
    """Compile every module in ``model.layers`` in place; returns how many were compiled.

    ``backend``/``mode``/``dynamic`` go to ``torch.compile`` (``backend="eager"`` checks the tracing
    without generating kernels). The caller's model keeps its identity, parameters and names.

    Raises:
        ValueError: ``model`` has no ``layers`` ``nn.ModuleList`` (not a megatron_geo Llama) or it is empty.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"compile_blocks needs a model with a non-empty `layers` ModuleList (a megatron_geo "
                         f"Llama), got {type(model).__name__}")
    for block in layers:
        block.compile(backend=backend, mode=mode, dynamic=dynamic)
    return len(layers)


def is_compiled(block: nn.Module) -> bool:
    """True when ``block`` was compiled in place by :func:`compile_blocks`."""
    return getattr(block, "_compiled_call_impl", None) is not None


__all__ = ["compile_blocks", "is_compiled"]
