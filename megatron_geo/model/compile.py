"""Optional torch.compile of each transformer block (``train.compile=true``).

Compiling per block instead of the whole model keeps compile time short (every block has the same code,
so one graph is reused by all of them), keeps the backward hooks of the gradient buckets outside the
compiled graphs (they fire per parameter as in eager mode), and keeps parameter names unchanged: the
blocks are compiled in place with ``nn.Module.compile``, so ``model.layers.3.mlp.down_proj.weight`` stays
what GeoFP8 layer patterns, checkpoints and the shard plan see.

Module hooks and compiled blocks: ``nn.Module.compile`` compiles the block's ``_call_impl``, so the block's
own forward (pre-)hooks and those of its submodules are traced *into* its graph, and dynamo does not guard on
module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): a hook added after the graph was built
would never run, and one that calls into the host (``Work.wait()``) breaks the graph. So no GeoFP8 or optimizer
module hook runs inside a compiled graph:

- GeoFP8's statistics pre-hooks (armed for the first micro-batch of a refresh step only) run with the blocks
  holding them executed eagerly for that micro-batch: :class:`eager_calls`, entered by
  :meth:`~megatron_geo.geometry.GeoState.arm` and left by ``disarm``; the compiled graph is neither rebuilt nor
  re-guarded, so each block keeps one graph.
- the distributed optimizer's parameter-gather waits run once per block from the model's forward loop, outside
  the block's call (:meth:`~megatron_geo.model.llama.Llama.register_block_pre_forward`).
"""

from __future__ import annotations

from torch import nn


def compile_blocks(
    model: nn.Module, backend: str = "inductor", mode: str | None = None, dynamic: bool | None = False
) -> int:
    """Compile every module in ``model.layers`` in place; returns how many were compiled.

    ``backend``/``mode``/``dynamic`` go to ``torch.compile`` (``backend="eager"`` checks the tracing
    without generating kernels). The caller's model keeps its identity, parameters and names.

    Raises:
        ValueError: ``model`` has no ``layers`` ``nn.ModuleList`` (not a megatron_geo Llama) or it is empty.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"compile_blocks needs a model with a non-empty `layers` ModuleList (a megatron_geo "
            f"Llama), got {type(model).__name__}"
        )
    for block in layers:
        block.compile(backend=backend, mode=mode, dynamic=dynamic)
    return len(layers)


def is_compiled(block: nn.Module) -> bool:
    """True when ``block`` was compiled in place by :func:`compile_blocks` (``nn.Module.compile``) and is not
    currently bypassed by :class:`eager_calls`."""
    return getattr(block, "_compiled_call_impl", None) is not None


class eager_calls:  # noqa: N801 - used like a function: ``with eager_calls(modules):``
    """Run modules compiled in place (``nn.Module.compile``) eagerly while the context is active.

    Each module of ``modules`` whose call is compiled has its compiled call put aside on enter (its
    ``__call__`` then runs the ordinary ``_call_impl``: forward, hooks and all, in eager mode) and put back on
    exit; modules that are not compiled are left alone. Nothing is recompiled or invalidated, so the next
    compiled call reuses the graph built before. Re-entrant per instance is not supported (enter once, exit
    once); nested instances over the same module are fine (the inner one finds it already eager).

    Args:
        modules: the modules to run eagerly (any iterable of ``nn.Module``; duplicates are ignored).
    """

    def __init__(self, modules):
        self.modules = list({id(m): m for m in modules}.values())
        self._saved: list[tuple[nn.Module, object]] = []

    def __enter__(self) -> eager_calls:
        if self._saved:
            raise RuntimeError("eager_calls is already active; exit it before entering it again")
        for m in self.modules:
            fn = getattr(m, "_compiled_call_impl", None)
            if fn is not None:
                self._saved.append((m, fn))
                m._compiled_call_impl = None
        return self

    def __exit__(self, *exc) -> None:
        saved, self._saved = self._saved, []
        for m, fn in reversed(saved):
            m._compiled_call_impl = fn

    @property
    def bypassed(self) -> list[nn.Module]:
        """The compiled modules currently running eagerly because of this context."""
        return [m for m, _ in self._saved]


__all__ = ["compile_blocks", "eager_calls", "is_compiled"]
