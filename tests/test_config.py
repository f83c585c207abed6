"""Config loading, merging, overrides and the validation messages users see."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_geo.config import ConfigError, load_config
from megatron_geo.training.validate import validate_config

ROOT = Path(__file__).resolve().parents[1]


def test_merge_order_and_overrides(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("train:\n  steps: 5\ncomm:\n  dtype: fp32\n")
    b = tmp_path / "b.yaml"
    b.write_text("comm:\n  dtype: bf16\n")
    cfg = load_config([str(a), str(b)], ["train.steps=7", "optimizer.lr=2e-4", "parallel.distributed_optimizer=false"])
    assert cfg.train.steps == 7 and cfg.comm.dtype == "bf16" and cfg.optimizer.lr == 2e-4
    assert cfg.parallel.distributed_optimizer is False


@pytest.mark.parametrize(
    "override,message",
    [
        (["train.stpes=3"], "Did you mean 'train.steps'"),
        (["trian.steps=3"], "Did you mean 'train'"),
        (["train.steps=abc"], "expected an integer, got 'abc'"),
        (["parallel.distributed_optimizer=maybe"], "expected true/false"),
        (["trainsteps"], "section.key=value"),
    ],
)
def test_bad_keys_and_types(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], override)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([str(tmp_path / "nope.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([str(bad)])


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.tensor=2"], 3, "world size 3 is not divisible by parallel.tensor=2"),
        (
            ["parallel.tensor=4", "model.num_kv_heads=2"],
            4,
            "model.num_kv_heads=2 is not divisible by parallel.tensor=4",
        ),
        (
            ["parallel.tensor=8", "model.num_attention_heads=4", "model.num_kv_heads=4"],
            8,
            "model.num_attention_heads=4 is not divisible by parallel.tensor=8",
        ),
        (["train.global_batch_size=10", "train.micro_batch_size=4"], 2, "not divisible by train.micro_batch_size=4"),
        (["comm.dtype=fp7"], 1, "comm.dtype='fp7' is not supported"),
        (["optimizer.name=muon", "parallel.tensor=2"], 2, "muon with parallel.tensor>1"),
        (["model.hidden_size=130"], 1, "not divisible by model.num_attention_heads"),
    ],
)
def test_size_validation(overrides, world, message):
    cfg = load_config([str(ROOT / "configs/tiny.yaml")], overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(cfg, world)


def test_cli_reports_config_errors_before_any_process_group():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_llama.py"),
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "train.global_batch_size=6",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "2", "RANK": "0"},
    )
    assert out.returncode == 2
    assert "train.global_batch_size=6 is not divisible" in out.stderr


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_sketch_size_below_rank_is_refused_only_where_a_sketch_is_used():
    """geo.sketch_size bounds the rank of a sketched factor only; full statistics keep any rank."""
    validate_config(load_config(GEO, ["geo.statistics=full", "geo.rank=96"]), 1)  # the default sketch is 64
    for stats in ("sketch", "auto"):
        with pytest.raises(ConfigError, match=r"geo.sketch_size=64 must be >= geo.rank=96"):
            validate_config(load_config(GEO, [f"geo.statistics={stats}", "geo.rank=96"]), 1)


def test_print_config_under_a_launcher_prints_once(tmp_path):
    """Every process of a launch checks the config, only rank 0 prints it (one copy in a torchrun log)."""
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "train.steps=3", "--print-config"]
    outs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
        r = subprocess.run(
            [sys.executable, str(ROOT / "pretrain_llama.py"), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert load_config([str(_write(tmp_path / "r.yaml", outs[0]))]).train.steps == 3 and outs[1] == ""


def test_print_config_roundtrip(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_llama.py"),
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "--config",
            str(ROOT / "configs/comm/bf16.yaml"),
            "train.steps=3",
            "--print-config",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    f = tmp_path / "resolved.yaml"
    f.write_text(out.stdout)
    cfg = load_config([str(f)])
    assert cfg.train.steps == 3 and cfg.comm.dtype == "bf16" and cfg.model.hidden_size == 128


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optimizer.lr=-0.001"], "optimizer.lr=-0.001 must be a positive finite number"),
        (["optimizer.lr=inf"], "optimizer.lr=inf must be a positive finite number"),
        (["optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 must be between 0 and optimizer.lr"),
        (["optimizer.beta1=1.5"], r"optimizer.beta1=1.5 must be in \[0, 1\)"),
        (["optimizer.clip_grad=-1"], "optimizer.clip_grad=-1.0 must be >= 0"),
        (["parallel.backend=nccl", "train.device=cpu"], "parallel.backend=nccl needs CUDA"),
        (
            ["comm.dtype=bf16", "comm.scale_sync=max"],
            "comm.scale_sync=max needs a low-precision comm.dtype .* drop comm.scale_sync",
        ),
        (["comm.dtype=fp32", "comm.rounding=stochastic"], "comm.rounding=stochastic needs a low-precision"),
        (["comm.dtype=nvfp4", "comm.scaling=block"], "comm.scaling=block does not apply to comm.dtype=nvfp4"),
    ],
)
def test_optimizer_and_backend_validation(overrides, message):
    cfg = load_config([str(ROOT / "configs/tiny.yaml")], overrides)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 1)


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    cfg = load_config([str(ROOT / "configs/tiny.yaml")], [f"train.run_dir={f}/sub"])
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        validate_config(cfg, 1)


def test_dataset_from_another_tokenizer_is_rejected(tmp_path):
    from megatron_geo.data import IndexedDatasetBuilder, train_tokenizer
    from megatron_geo.training.data_setup import build_data

    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"line {i} of a small corpus with some words {i * 7}" for i in range(300)))
    tok = train_tokenizer([str(text)], str(tmp_path / "tok"), vocab_size=64)
    b = IndexedDatasetBuilder(str(tmp_path / "train"), vocab_size=500)  # "another" tokenizer's vocab
    b.add_document(list(range(400)) + [2])
    b.finalize()
    cfg = load_config(
        [str(ROOT / "configs/tiny.yaml")],
        [
            "data.source=indexed",
            f"data.train_prefix={tmp_path}/train",
            f"data.tokenizer_model={tok}",
            "model.vocab_size=64",
            "model.seq_length=16",
        ],
    )
    with pytest.raises(ConfigError, match=r"holds token id 64 \(sequence 0\), outside the 64-id vocab"):
        build_data(cfg, None)


GEO = [str(ROOT / "configs/tiny.yaml"), str(ROOT / "configs/comm/geofp8.yaml")]


@pytest.mark.parametrize(
    "value,message",
    [
        ("abc", r"geo.power_search='abc': 'abc' is not a power in \[0, 1\]"),
        ("0.5,2", r"'2' is not a power in \[0, 1\]"),
        ("-0.1", r"'-0.1' is not a power"),
        ("nan", r"'nan' is not a power"),
        ("0.5,0.25,0.5", "repeats 0.5"),
        ("0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8", "has 9 powers; at most 8"),
    ],
)
def test_power_search_validation(value, message):
    cfg = load_config(GEO, [f"geo.power_search={value}"])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 1)


def test_power_search_accepts_a_yaml_list_and_the_preset(tmp_path):
    from megatron_geo.training.validate import parse_power_search

    f = tmp_path / "ps.yaml"
    f.write_text("geo:\n  power_search: [0.5, 0.25, 0]\n  layers: [layers.0.mlp.down_proj.weight, layers.1.*]\n")
    cfg = load_config(GEO + [str(f)])
    validate_config(cfg, 1)
    assert parse_power_search(cfg.geo.power_search) == (0.5, 0.25, 0.0)
    assert cfg.geo.layers == "layers.0.mlp.down_proj.weight,layers.1.*"
    preset = load_config([str(ROOT / "configs/tiny.yaml"), str(ROOT / "configs/comm/geofp8_search.yaml")])
    validate_config(preset, 1)
    assert parse_power_search(preset.geo.power_search) == (0.5, 0.375, 0.25, 0.125, 0.0)
    assert parse_power_search("") == ()
    # a list where a plain string is expected is still an error
    g = tmp_path / "bad.yaml"
    g.write_text("comm:\n  dtype: [fp8_e4m3]\n")
    with pytest.raises(ConfigError, match="expected a string"):
        load_config([str(g)])


# -- values are typed against the schema field, never guessed first --------------------------------------------


@pytest.mark.parametrize("text", ["2.5e0", "2.5", "2.5E+0", "nan", "inf", "3x"])
def test_non_integral_values_for_integer_keys_are_errors_in_every_spelling(tmp_path, text):
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer"):
        load_config([], [f"train.steps={text}"])
    f = tmp_path / "c.yaml"
    f.write_text(f"train:\n  steps: {text}\n")
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer"):
        load_config([str(f)])


def test_integral_spellings_and_string_keys_keep_what_was_written(tmp_path):
    assert load_config([], ["train.steps=1e30"]).train.steps == 10**30  # exact, not via a float
    cfg = load_config(
        [],
        [
            "train.steps=1e3",
            "parallel.bucket_size=4_000_000",
            "train.run_dir=1e3",
            "logging.wandb_name=0.10",
            "parallel.distributed_optimizer=yes",
        ],
    )
    assert (cfg.train.steps, cfg.parallel.bucket_size) == (1000, 4_000_000)
    # the text, not str(float) (a path is made absolute)
    assert (cfg.train.run_dir, cfg.logging.wandb_name) == (os.path.abspath("1e3"), "0.10")
    assert cfg.parallel.distributed_optimizer is True
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 2.0\n  run_dir: 0x10\nlogging:\n  wandb_name: 007\n")
    cfg = load_config([str(f)])
    assert (cfg.train.steps, cfg.train.run_dir, cfg.logging.wandb_name) == (2, os.path.abspath("0x10"), "007")


# -- every file and device named in the config is checked before any process group starts ---------------------


def _pretrain(*args, nproc=None, timeout=120):
    cmd = (
        [sys.executable, "pretrain_llama.py"]
        if nproc is None
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            "29533",
            "pretrain_llama.py",
        ]
    )
    return subprocess.run(
        cmd + ["--config", "configs/tiny.yaml", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "extra,expect",
    [
        (
            ["data.train_prefix=data/trian"],
            r"data\.train_prefix='/\S*/data/trian': '/\S*/data/trian\.bin' and '/\S*/data/trian\.idx' "
            r"not found",
        ),
        (["data.train_prefix={ok}", "data.valid_prefix=nowhere/v"], r"data\.valid_prefix='/\S*/nowhere/v'"),
        (
            ["data.train_prefix={ok}", "data.tokenizer_model=nope.model"],
            r"data\.tokenizer_model='/\S*/nope\.model' not found",
        ),
        (["data.train_prefix={ok}", "train.device=cuda"], r"train\.device=cuda but CUDA is not available"),
    ],
)
def test_missing_files_and_devices_are_one_error_line_before_any_process_group(tmp_path, extra, expect):
    if "cuda" in expect:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    from megatron_geo.data import IndexedDatasetBuilder

    ok = tmp_path / "d"  # a well-formed dataset: the files' headers are checked too
    with IndexedDatasetBuilder(str(ok), vocab_size=2048) as builder:
        builder.add_document([5, 6, 7, 1])
    tok = tmp_path / "t.model"
    tok.write_bytes(b"")
    args = ["data.source=indexed", f"data.tokenizer_model={tok}", f"train.run_dir={tmp_path / 'run'}"] + [
        e.format(ok=ok) for e in extra
    ]
    for nproc in (None, 2) if "trian" in expect else (None,):  # under torchrun once (the same code path)
        r = _pretrain(*args, nproc=nproc)
        assert r.returncode in (2, 1 if nproc else 2), r.stderr[-2000:]
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and re.search(expect, errors[0]), r.stderr[-2000:]
        # no traceback of ours (torchrun prints its own ChildFailedError report after any non-zero exit)
        assert 'pretrain_llama.py", line' not in r.stderr and "megatron_geo/" not in r.stderr
        assert "waiting for" not in r.stdout
        if nproc is None:
            assert "Traceback" not in r.stderr
    if "cuda" not in expect:  # the Slurm wrappers' pre-flight check (--print-config) catches the files too
        r = _pretrain(*args, "--print-config")
        assert r.returncode == 2 and re.search(expect, r.stderr), r.stderr


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["comm.dtype=fp8_e4m3", "geo.power=abc"], r"geo.power='abc' must be a number in \(0, 1\]"),  # without geo too
        (["comm.dtype=fp8_e4m3", "comm.transform=geo", "geo.rank=0"], r"^geo.rank=0 must be >= 1$"),
        (["comm.dtype=fp8_e4m3", "comm.transform=geo", "geo.damping=-1"], r"^geo.damping=-1.0 must be > 0"),
    ],
)
def test_geo_values_name_the_one_bad_key(overrides, message):
    cfg = load_config([], overrides)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 1)


def test_comm_compile_on_cpu_without_a_cxx_compiler_is_one_error_line(tmp_path):
    """comm.compile=true on CPU needs inductor's C++ compiler: without one, the launch stops before training with
    one ``error:`` line naming the key and the fix (exit 2), and nothing is written."""
    import os

    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "WANDB_MODE": "disabled"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_llama.py"),
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "--config",
            str(ROOT / "configs/comm/fp8.yaml"),
            "comm.compile=true",
            "train.device=cpu",
            f"train.run_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: comm.compile=true") and "comm.compile=false" in lines[0]
    assert "C++ compiler" in lines[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_wandb_logging_without_the_wandb_package_is_a_start_up_error(monkeypatch):
    """A machine without wandb (e.g. a GPU image) fails before any process group, naming the key and the fix."""
    import importlib.util

    from helpers import tiny_cfg
    from megatron_geo.config import ConfigError
    from megatron_geo.training.validate import check_inputs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb=offline needs the wandb package.*logging.wandb=disabled"):
        check_inputs(tiny_cfg("logging.wandb=offline"), devices=False)
    check_inputs(tiny_cfg("logging.wandb=disabled"), devices=False)  # no wandb needed
