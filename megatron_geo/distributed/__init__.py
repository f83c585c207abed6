"""Bucketed FP32 gradient buffers, overlapped DP reduction and the distributed optimizer."""

from .buckets import Bucket, build_buckets, register_buckets
from .data_parallel import GradSync
from .optimizer import DistributedOptimizer
from .plan_types import Piece, ShardPlan
from .shard_plan import plan_shards

__all__ = [
    "Bucket",
    "DistributedOptimizer",
    "GradSync",
    "Piece",
    "ShardPlan",
    "build_buckets",
    "plan_shards",
    "register_buckets",
]
