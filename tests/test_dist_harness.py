"""The test harness itself: ranks are forked from a server that has already imported torch and the package."""

import sys

from dist_harness import run_distributed


def _imported(rank, world):
    # dist_preload is imported by the fork server only: a rank that has it was forked from a preloaded server
    return "dist_preload" in sys.modules, "megatron_geo.training.trainer" in sys.modules


def test_ranks_start_from_the_preloaded_fork_server():
    assert run_distributed(_imported, 2) == [(True, True), (True, True)]
