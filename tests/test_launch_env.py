"""Launcher detection: torchrun, srun (one process per task) and a plain single process."""

import pytest

from megatron_geo.parallel.launch_env import LaunchError, _expand_first_host, detect_launch_env

CLEAR = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
         "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID"]


@pytest.fixture
def env(monkeypatch):
    for k in CLEAR:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: exercise our own node-list parser
    return monkeypatch


def test_single_process(env):
    e = detect_launch_env()
    assert (e.rank, e.world_size, e.launcher) == (0, 1, "single")


def test_torchrun(env):
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "4")
    env.setenv("LOCAL_RANK", "1")
    env.setenv("MASTER_ADDR", "node7")
    env.setenv("MASTER_PORT", "1234")
    e = detect_launch_env()
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == \
        (3, 4, 1, "node7", 1234, "torchrun")


def test_srun(env):
    env.setenv("SLURM_PROCID", "5")
    env.setenv("SLURM_NTASKS", "64")
    env.setenv("SLURM_LOCALID", "0")
    env.setenv("SLURM_JOB_NODELIST", "gh[012-075],login1")
    env.setenv("SLURM_JOB_ID", "4242")
    e = detect_launch_env()
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == \
        (5, 64, 0, "gh012", 29500 + 242, "slurm")


@pytest.mark.parametrize("nodelist,first", [("n1", "n1"), ("n[1-2]", "n1"), ("c[3,5-7]", "c3"), ("a,b", "a")])
def test_nodelist_first_host(nodelist, first):
    assert _expand_first_host(nodelist) == first


def test_bad_rank(env):
    env.setenv("RANK", "4")
    env.setenv("WORLD_SIZE", "4")
    with pytest.raises(LaunchError, match="outside world size 4"):
        detect_launch_env()
    env.setenv("RANK", "x")
    with pytest.raises(LaunchError, match="RANK='x' is not an integer"):
        detect_launch_env()


@pytest.mark.parametrize("bad, message", [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "a"}, "LOCAL_RANK='a' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "rank 3 is outside world size 2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "x1"},
     "SLURM_JOB_ID='x1' is not an integer"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_LOCALID": "?"},
     "SLURM_LOCALID='\\?' is not an integer"),
])
def test_bad_launch_variables_are_clear_errors(env, bad, message):
    for k, v in bad.items():
        env.setenv(k, v)
    with pytest.raises(LaunchError, match=message):
        detect_launch_env()


# -- c06: Slurm's full host-list syntax in the fallback (no scontrol) ----------------------------------------------

@pytest.mark.parametrize("nodelist,hosts", [
    ("rack[1-2]-ib", ["rack1-ib", "rack2-ib"]),
    ("gh[001-003,070],login1", ["gh001", "gh002", "gh003", "gh070", "login1"]),
    ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
    ("a-[7]-b,c[2]", ["a-7-b", "c2"]),
    ("node7", ["node7"]),
])
def test_hostlist_expansion_follows_slurm_syntax(nodelist, hosts):
    from megatron_geo.parallel.launch_env import expand_hostlist

    assert expand_hostlist(nodelist) == hosts
    assert _expand_first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[3-1]", "n[a-b]", "", "x[1-2]]"])
def test_unparsable_hostlist_is_a_clear_error(bad):
    with pytest.raises(LaunchError, match=r"SLURM_JOB_NODELIST=.*set MASTER_ADDR"):
        _expand_first_host(bad)
