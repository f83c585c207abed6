"""Launcher detection: torchrun, srun (one process per task) and a plain single process."""

from pathlib import Path

import pytest

from megatron_geo.parallel.launch_env import LaunchError, _expand_first_host, detect_launch_env

ROOT = Path(__file__).resolve().parent.parent

CLEAR = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
]


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
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (
        3,
        4,
        1,
        "node7",
        1234,
        "torchrun",
    )


def test_srun(env):
    env.setenv("SLURM_PROCID", "5")
    env.setenv("SLURM_NTASKS", "64")
    env.setenv("SLURM_LOCALID", "0")
    env.setenv("SLURM_JOB_NODELIST", "gh[012-075],login1")
    env.setenv("SLURM_JOB_ID", "4242")
    e = detect_launch_env()
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (
        5,
        64,
        0,
        "gh012",
        29500 + 242,
        "slurm",
    )


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


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "a"}, "LOCAL_RANK='a' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "rank 3 is outside world size 2"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "x1"},
            "SLURM_JOB_ID='x1' is not an integer",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_LOCALID": "?"},
            "SLURM_LOCALID='\\?' is not an integer",
        ),
    ],
)
def test_bad_launch_variables_are_clear_errors(env, bad, message):
    for k, v in bad.items():
        env.setenv(k, v)
    with pytest.raises(LaunchError, match=message):
        detect_launch_env()


# -- Slurm's full host-list syntax in the fallback (no scontrol) ----------------------------------------------


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("rack[1-2]-ib[1]", ["rack1-ib1", "rack2-ib1"]),
        ("gh[001-003,070],login1", ["gh001", "gh002", "gh003", "gh070", "login1"]),
        ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
        ("a-[7]-b[1],c[2]", ["a-7-b1", "c2"]),
        ("node7", ["node7"]),
    ],
)
def test_hostlist_expansion_follows_slurm_syntax(nodelist, hosts):
    from megatron_geo.parallel.launch_env import expand_hostlist

    assert expand_hostlist(nodelist) == hosts
    assert _expand_first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[3-1]", "n[a-b]", "", "x[1-2]]", "rack[1-2]-ib"])
def test_unparsable_hostlist_is_a_clear_error(bad):
    with pytest.raises(LaunchError, match=r"SLURM_JOB_NODELIST=.*set MASTER_ADDR"):
        _expand_first_host(bad)


# -- GPUs allotted by the launcher but CUDA unusable: a launch error, not a silent CPU run --------------------------

GPU_VARS = ["SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"]


@pytest.fixture
def gpu_env(env):
    """``env`` without any GPU allotment variable, CUDA unusable, and no process group allowed to start."""
    import torch
    import torch.distributed as dist

    for k in GPU_VARS:
        env.delenv(k, raising=False)
    env.setattr(torch.cuda, "is_available", lambda: False)

    def no_group(*a, **k):
        raise AssertionError("a process group was started")

    env.setattr(dist, "init_process_group", no_group)
    env.setattr(dist, "new_group", no_group)
    return env


@pytest.mark.parametrize(
    "name,value,allotted",
    [
        ("SLURM_GPUS_ON_NODE", "4", True),
        ("SLURM_GPUS_ON_NODE", "0", False),
        ("SLURM_STEP_GPUS", "0,1", True),
        ("SLURM_JOB_GPUS", "3", True),
        ("SLURM_JOB_GPUS", "", False),
        ("CUDA_VISIBLE_DEVICES", "0", True),
        ("CUDA_VISIBLE_DEVICES", "GPU-6f1c", True),
        ("CUDA_VISIBLE_DEVICES", "", False),
        ("CUDA_VISIBLE_DEVICES", "-1", False),
        ("CUDA_VISIBLE_DEVICES", "NoDevFiles", False),
    ],
)
def test_allotted_gpus_reads_the_launcher_variables(gpu_env, name, value, allotted):
    from megatron_geo.parallel.launch_env import allotted_gpus

    gpu_env.setenv(name, value)
    assert allotted_gpus() == ((name, value) if allotted else None)


def _main_stderr(args, capsys):
    from megatron_geo.training.cli import main

    rc = main(args)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "name,value", [("SLURM_GPUS_ON_NODE", "1"), ("SLURM_JOB_GPUS", "0"), ("CUDA_VISIBLE_DEVICES", "0")]
)
def test_auto_device_with_allotted_gpus_and_no_usable_cuda_exits_2(gpu_env, capsys, tmp_path, name, value):
    import torch

    gpu_env.setenv(name, value)
    run = tmp_path / "run"
    rc, err = _main_stderr(["--config", str(ROOT / "configs/tiny.yaml"), f"train.run_dir={run}"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"{name}='{value}'" in lines[0] and "train.device=cpu" in lines[0]
    fix = "install a CUDA build of torch" if torch.version.cuda is None else "fix the NVIDIA driver"
    assert fix in lines[0]
    assert not run.exists()  # nothing written: refused before the run started
    # a CUDA build of torch whose driver is unusable gets the driver fix
    gpu_env.setattr(torch.version, "cuda", "12.8")
    rc, err = _main_stderr(["--config", str(ROOT / "configs/tiny.yaml"), f"train.run_dir={run}"], capsys)
    assert rc == 2 and "fix the NVIDIA driver" in err and "CUDA 12.8" in err and "train.device=cpu" in err


def test_init_parallel_refuses_the_cpu_fallback_before_any_process_group(gpu_env):
    from megatron_geo.parallel import init_parallel

    gpu_env.setenv("SLURM_STEP_GPUS", "0")
    with pytest.raises(LaunchError, match=r"SLURM_STEP_GPUS='0' gives this process GPUs.*train\.device=cpu"):
        init_parallel(1, "auto", "auto", env=None)


def test_no_gpus_allotted_or_explicit_cpu_is_not_refused(gpu_env):
    """Plain CPU machines, a Slurm cluster that allots no GPUs, an explicit train.device=cpu and a node where
    CUDA works: no error."""
    import torch

    from megatron_geo.config import load_config
    from megatron_geo.parallel.launch_env import require_cuda_if_allotted
    from megatron_geo.training.validate import check_inputs

    auto = load_config([str(ROOT / "configs/tiny.yaml")])
    check_inputs(auto)  # no launcher variables at all
    for k, v in {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_GPUS_ON_NODE": "0",
        "CUDA_VISIBLE_DEVICES": "NoDevFiles",
    }.items():
        gpu_env.setenv(k, v)
    check_inputs(auto)  # a Slurm job without GPUs
    gpu_env.setenv("SLURM_GPUS_ON_NODE", "1")
    with pytest.raises(LaunchError, match="SLURM_GPUS_ON_NODE"):
        check_inputs(auto)
    check_inputs(load_config([str(ROOT / "configs/tiny.yaml")], ["train.device=cpu"]))  # on purpose
    require_cuda_if_allotted("cpu")
    gpu_env.setattr(torch.cuda, "is_available", lambda: True)  # CUDA works: nothing to refuse
    require_cuda_if_allotted("auto")


# -- an existing default process group with another backend -------------------------------------------------------


def test_init_parallel_refuses_an_existing_group_with_another_backend(world, monkeypatch):
    """A gloo world is up (as the test suite's ``world`` fixture leaves it) and init_parallel is asked for NCCL:
    a clear error before any group is built or any device is selected, instead of gloo groups labelled NCCL."""
    import torch
    import torch.distributed as dist

    from megatron_geo.parallel import init_parallel
    from megatron_geo.parallel.launch_env import LaunchEnv

    single = LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single")
    calls = []
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: calls.append("new_group"))
    with pytest.raises(
        LaunchError,
        match=r"backend 'gloo' is already initialised, but init_parallel would use "
        r"'nccl'.*destroy_process_group",
    ):
        init_parallel(1, "cpu", "nccl", env=single)
    # what a GPU test run sees: CUDA present, device=cuda, backend=auto -> nccl over the gloo world
    for name, fn in {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda i: calls.append(("set_device", i)),
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    with pytest.raises(LaunchError, match="would use 'nccl'"):
        init_parallel(1, "cuda", "auto", env=single)
    assert calls == [] and dist.get_backend() == "gloo"
    monkeypatch.undo()
    pctx = init_parallel(1, "cpu", "auto", env=single)  # the same backend: the world is reused
    assert pctx.backend == "gloo" and dist.get_backend(pctx.dp_group) == "gloo"
