"""Explicit parallel context (TP x DP groups) and launcher detection."""

from .context import ParallelContext, build_groups, destroy_parallel, indexed_device, init_parallel
from .launch_env import LaunchEnv, LaunchError, detect_launch_env

__all__ = [
    "LaunchEnv",
    "LaunchError",
    "ParallelContext",
    "build_groups",
    "destroy_parallel",
    "detect_launch_env",
    "indexed_device",
    "init_parallel",
]
