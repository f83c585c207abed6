"""Tensor-parallel collectives, layers and vocab-parallel cross entropy."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "vocab_parallel_cross_entropy",
]
