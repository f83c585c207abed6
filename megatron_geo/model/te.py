"""``model.transformer_impl=transformer_engine``: NVIDIA Transformer Engine kernels inside the same model.

The Llama keeps its own structure, parameters, names, initialisation and tensor-parallel communication;
only the local compute is swapped: every column/row-parallel projection runs its shard through a
``transformer_engine.pytorch.Linear`` that *shares* the layer's weight Parameter (so buckets, the
distributed optimizer, checkpoints and GeoFP8 see exactly the same tensors), and every RMSNorm becomes
``transformer_engine.pytorch.RMSNorm`` holding the same weight Parameter. Attention stays
``scaled_dot_product_attention`` (flash/cuDNN kernels on Hopper already). This module is imported only
when that implementation is asked for; ``transformer_impl=local`` never imports Transformer Engine.
"""

from __future__ import annotations

from torch import nn

from ..config import ConfigError


def load_transformer_engine():
    """``transformer_engine.pytorch``, or a :class:`ConfigError` saying how to get it."""
    try:
        import transformer_engine.pytorch as te_pt  # noqa: PLC0415
    except Exception as e:  # ImportError, or TE's own errors when its CUDA libraries do not load
        raise ConfigError(
            f"model.transformer_impl=transformer_engine but Transformer Engine cannot be imported "
            f"({type(e).__name__}: {e}); use the NGC PyTorch container (see the Dockerfile) or "
            f"pip install 'transformer_engine[pytorch]', or set model.transformer_impl=local"
        ) from None
    return te_pt


def use_transformer_engine(model: nn.Module, te_pt=None, require_cuda: bool = True) -> int:
    """Swap the local compute of ``model`` (a megatron_geo Llama) to Transformer Engine in place.

    ``te_pt``: the ``transformer_engine.pytorch`` module (default: imported here). Returns the number of
    layers swapped (linear projections + norms). Parameter objects and names are unchanged.

    Raises:
        ConfigError: Transformer Engine is not importable, or the model is not on a CUDA device while
            ``require_cuda`` (TE kernels are CUDA only).
    """
    from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    te_pt = te_pt or load_transformer_engine()
    dev = next(model.parameters()).device
    if require_cuda and dev.type != "cuda":
        raise ConfigError(
            f"model.transformer_impl=transformer_engine needs CUDA, but the model is on {dev}; "
            f"set model.transformer_impl=local for CPU runs"
        )
    swapped = 0
    for module in list(model.modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            w = module.weight
            lin = te_pt.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=w.dtype, device=dev)
            lin.weight = w  # share the Parameter: one tensor, one gradient, one name
            module.__dict__["te_linear"] = lin  # not a submodule: no second name for the weight
            swapped += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.RMSNorm):
                norm = te_pt.RMSNorm(
                    child.weight.shape[0],
                    eps=child.eps if child.eps is not None else 1e-5,
                    params_dtype=child.weight.dtype,
                    device=dev,
                )
                norm.weight = child.weight
                setattr(parent, name, norm)
                swapped += 1
    return swapped
