"""Bucketed FP32 gradient buffers, overlapped DP reduction and the distributed optimizer."""

from .buckets import Bucket, build_buckets
from .data_parallel import GradSync
from .optimizer import DistributedOptimizer
from .shard_plan import Piece, ShardPlan, plan_shards

__all__ = ["Bucket", "DistributedOptimizer", "GradSync", "Piece", "ShardPlan", "build_buckets", "plan_shards"]
