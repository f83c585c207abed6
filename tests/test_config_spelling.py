"""One meaning per config spelling: duplicate YAML keys, nulls, merge keys, path expansion, and keys that the
other settings give no effect."""

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from megatron_geo.config import Config, ConfigError, dump_config, load_config
from megatron_geo.training.validate import check_inputs, reject_inert_keys, validate_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
NULLS = ["~", "null", "Null", "NULL", ""]


def _write(tmp_path, text: str, name: str = "c.yaml") -> str:
    f = tmp_path / name
    f.write_text(text)
    return str(f)


def _all_fields():
    """``(section, key, type, default)`` of every field of the schema."""
    out = []
    for sec in dataclasses.fields(Config):
        cls = sec.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append((sec.name, f.name, hints[f.name], f.default))
    return out


FIELDS = _all_fields()
IDS = [f"{s}.{k}" for s, k, _, _ in FIELDS]


def _other_value(typ, default) -> str:
    """A YAML text for a value of ``typ`` that is not ``default`` (loads without the cross-key validation)."""
    if typ is bool:
        return "false" if default else "true"
    if typ is int:
        return str(default + 3)
    if typ is float:
        return repr(float(default) + 0.25)
    if typing.get_origin(typ) is typing.Literal:  # another of the key's choices
        return next(v for v in typing.get_args(typ) if v != default)
    return "spelled-x"


def _line_of(text: str, needle: str, nth: int) -> int:
    """1-based line of the ``nth`` (0-based) occurrence of ``needle`` in ``text``."""
    starts = [m.start() for m in re.finditer(re.escape(needle), text)]
    return text.count("\n", 0, starts[nth]) + 1


# -- duplicate keys --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,key,needle",
    [
        ("train: {steps: 50}\ncomm:\n  dtype: bf16\ntrain: {global_batch_size: 32}\n", "train", "train:"),
        ("train: {steps: 5, steps: 9}\n", "train.steps", "steps:"),
        ("train:\n  steps: 5\n  seed: 3\n  steps: 9\n", "train.steps", "steps:"),
        ("train:\n  'steps': 5\n  \"steps\": 9\n", "train.steps", "steps"),  # quoting is the same key
        ("x-base:\n  inner:\n    k: 1\n    k: 2\ntrain: {steps: 5}\n", "x-base.inner.k", "k:"),  # any depth
        ("train:\n  <<: {steps: 1}\n  <<: {seed: 2}\n", "train.<<", "<<"),
    ],
)
def test_a_duplicate_key_is_an_error_naming_the_file_key_and_both_lines(tmp_path, text, key, needle):
    f = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config([f])
    msg = str(e.value)
    second, first = _line_of(text, needle, 1), _line_of(text, needle, 0)
    assert f in msg and f"duplicate key '{key}'" in msg, msg
    assert f"line {second}:" in msg and f"first at line {first}" in msg, msg


def test_same_key_in_different_sections_and_later_files_is_no_duplicate(tmp_path):
    a = _write(tmp_path, "train: {steps: 5}\ncheckpoint: {interval: 5}\n", "a.yaml")
    b = _write(tmp_path, "train: {steps: 9}\n", "b.yaml")
    cfg = load_config([a, b])
    assert (cfg.train.steps, cfg.checkpoint.interval) == (9, 5)


# -- null ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("section,key,typ,default", FIELDS, ids=IDS)
def test_a_yaml_null_is_the_default_of_every_field_also_over_an_earlier_file(tmp_path, section, key, typ, default):
    reference = getattr(getattr(load_config([]), section), key)  # the key never given
    first = _write(tmp_path, f"{section}:\n  {key}: {_other_value(typ, default)}\n", "first.yaml")
    assert getattr(getattr(load_config([first]), section), key) != reference
    for i, spelling in enumerate(NULLS):
        f = _write(tmp_path, f"{section}:\n  {key}: {spelling}\n", f"null{i}.yaml")
        assert getattr(getattr(load_config([f]), section), key) == reference, spelling
        assert getattr(getattr(load_config([first, f]), section), key) == reference, spelling


@pytest.mark.parametrize("section,key,typ,default", FIELDS, ids=IDS)
def test_an_override_null_is_the_default_and_an_empty_override_is_empty_text(tmp_path, section, key, typ, default):
    reference = getattr(getattr(load_config([]), section), key)
    first = _write(tmp_path, f"{section}:\n  {key}: {_other_value(typ, default)}\n")
    for spelling in ("null", "Null", "NULL", "~"):
        assert getattr(getattr(load_config([first], [f"{section}.{key}={spelling}"]), section), key) == reference
    required_path = (section, key) in (("train", "run_dir"), ("data", "cache_dir"), ("checkpoint", "load"))
    if typ is str and not required_path:
        assert getattr(getattr(load_config([first], [f"{section}.{key}="]), section), key) in ("", reference)
    else:  # a number, a flag or a required path cannot be empty
        with pytest.raises(ConfigError, match=rf"{section}\.{key}.*empty.*null for the default"):
            load_config([first], [f"{section}.{key}="])


def test_quoted_null_words_are_text_and_survive_the_dumped_config(tmp_path):
    f = _write(
        tmp_path,
        "comm:\n  label: \"null\"\nlogging:\n  wandb_name: '~'\n  wandb_group: 'NULL'\n  wandb_project: '<<'\n",
    )
    cfg = load_config([f])
    assert (cfg.comm.label, cfg.logging.wandb_name, cfg.logging.wandb_group, cfg.logging.wandb_project) == (
        "null",
        "~",
        "NULL",
        "<<",
    )
    again = load_config([_write(tmp_path, dump_config(cfg), "dumped.yaml")])
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_null_label_and_null_checkpoint_dir_take_the_derived_defaults(tmp_path, monkeypatch):
    from megatron_geo.checkpoint.manager import checkpoint_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    f = _write(tmp_path, f"train: {{run_dir: {run}}}\ncheckpoint: {{dir: ~}}\ncomm: {{label: null}}\n")
    cfg = load_config([TINY, str(ROOT / "configs/comm/fp8_ef.yaml"), f])
    assert cfg.comm.label == "fp8_ef"  # the preset's name, as without the key
    assert checkpoint_root(cfg) == run / "checkpoints"  # not $HOME
    labelled = _write(tmp_path, "comm: {label: mine}\n", "labelled.yaml")
    assert load_config([TINY, labelled]).comm.label == "mine"
    assert load_config([TINY, labelled, f]).comm.label == "fp32"  # a later null drops the earlier label
    assert load_config([TINY, labelled], ["comm.label=null"]).comm.label == "fp32"


def test_a_null_or_empty_section_sets_nothing(tmp_path):
    first = _write(tmp_path, "train: {steps: 7}\n", "a.yaml")
    for body in ("train:\n", "train: ~\n", "train:\n  # steps: 9\n"):
        assert load_config([first, _write(tmp_path, body, "b.yaml")]).train.steps == 7


def test_a_null_list_element_is_an_error(tmp_path):
    f = _write(tmp_path, "geo:\n  layers: [layers.0.mlp.down_proj.weight, ~]\n")
    with pytest.raises(ConfigError, match="geo.layers: the list .* has an empty element"):
        load_config([f])


# -- merge keys ------------------------------------------------------------------------------------------------------


def test_merge_keys_follow_yaml_1_1(tmp_path):
    text = (
        "x-short: &short {steps: 7, eval_interval: 5}\n"
        "x-seed: &seed {seed: 3, steps: 8, log_interval: 2}\n"
        "train:\n"
        "  <<: [*short, *seed]        # the earlier mapping wins: steps 7\n"
        "  log_interval: 4            # an explicit key wins over merged ones\n"
        "logging:\n"
        "  <<: {wandb_name: 007, wandb_group: yes}\n"
    )
    cfg = load_config([_write(tmp_path, text)])
    assert (cfg.train.steps, cfg.train.eval_interval, cfg.train.seed, cfg.train.log_interval) == (7, 5, 3, 4)
    assert (cfg.logging.wandb_name, cfg.logging.wandb_group) == ("007", "yes")  # still no implicit typing
    inline = load_config([_write(tmp_path, "train: {<<: {steps: 7}, seed: 3}\n", "i.yaml")])
    assert (inline.train.steps, inline.train.seed) == (7, 3)
    single = load_config([_write(tmp_path, "x-a: &a {steps: 6}\ntrain: {<<: *a, seed: 2}\n", "s.yaml")])
    assert (single.train.steps, single.train.seed) == (6, 2)


@pytest.mark.parametrize(
    "text,message",
    [
        ("train:\n  <<: 5\n", "merge key '<<' in 'train' takes a mapping or a list of mappings"),
        ("train:\n  <<: [{steps: 1}, 2]\n", "merge key '<<' in 'train' takes a mapping"),
        ("train:\n  '<<': {steps: 1}\n", "unknown key 'train.<<'"),  # quoted, it is a plain key
        ("x-a: &a\n  <<: *a\n", "contains itself"),
    ],
)
def test_bad_merge_keys_are_one_clear_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config([_write(tmp_path, text)])


# -- paths -----------------------------------------------------------------------------------------------------------

PATH_KEYS = [
    "train.run_dir",
    "data.cache_dir",
    "data.train_prefix",
    "data.valid_prefix",
    "data.tokenizer_model",
    "checkpoint.dir",
    "checkpoint.load",
]


def test_every_path_field_of_the_schema_is_marked():
    from megatron_geo.config import schema

    marked = [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(Config)
        for f in dataclasses.fields(s.default_factory)
        if f.metadata.get("path")
    ]
    assert sorted(marked) == sorted(PATH_KEYS)
    assert hasattr(schema, "path_field")


@pytest.mark.parametrize("key", PATH_KEYS)
def test_tilde_and_variables_expand_once_in_every_path_key(tmp_path, monkeypatch, key):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MG_SPELL_DIR", str(tmp_path / "v"))
    sec, name = key.split(".")
    get = lambda cfg: getattr(getattr(cfg, sec), name)  # noqa: E731
    assert get(load_config([], [f"{key}=~/p/{name}"])) == f"{home}/p/{name}"
    f = _write(tmp_path, f"{sec}:\n  {name}: $MG_SPELL_DIR/{name}\n")
    assert get(load_config([f])) == f"{tmp_path}/v/{name}"
    g = _write(tmp_path, f"{sec}:\n  {name}: ${{MG_SPELL_DIR}}/a/~b\n", "g.yaml")
    assert get(load_config([g])) == f"{tmp_path}/v/a/~b"  # only a leading ~ is a home folder
    monkeypatch.delenv("MG_NOT_SET_X", raising=False)
    with pytest.raises(ConfigError, match=rf"{key}=.*'MG_NOT_SET_X' is not set"):
        load_config([], [f"{key}=$MG_NOT_SET_X/y"])


def test_the_default_cache_dir_and_checkpoint_keywords(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config([])
    assert cfg.data.cache_dir == f"{tmp_path}/.cache/megatron_geo"
    for word in ("auto", "latest", "none"):
        assert load_config([], [f"checkpoint.load={word}"]).checkpoint.load == word


@pytest.mark.parametrize(
    "key,required",
    [
        ("train.run_dir", True),
        ("data.cache_dir", True),
        ("checkpoint.load", True),
        ("checkpoint.dir", False),
        ("data.train_prefix", False),
    ],
)
def test_an_empty_path_is_an_error_where_one_is_required(tmp_path, key, required):
    f = _write(tmp_path, f"{key.split('.')[0]}:\n  {key.split('.')[1]}: ''\n")
    for args in (([], [f"{key}="]), ([f], [])):
        if required:
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is empty"):
                load_config(*args)
        else:
            cfg = load_config(*args)
            assert getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) == ""


def test_run_dir_under_home_puts_config_metrics_and_checkpoints_in_one_folder(tmp_path, monkeypatch):
    from megatron_geo.checkpoint.manager import checkpoint_root
    from megatron_geo.training.cli import prepare_output_dirs

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MG_SPELL_RUNS", str(tmp_path / "runs"))
    monkeypatch.chdir(cwd)
    yaml_run = _write(tmp_path, "train:\n  run_dir: $MG_SPELL_RUNS/y\n", "run.yaml")
    for files, overrides, expected in (
        ([TINY], ["train.run_dir=~/x"], home / "x"),
        ([TINY, yaml_run], [], tmp_path / "runs" / "y"),
    ):
        cfg = load_config(files, overrides)
        prepare_output_dirs(cfg)  # what the trainer creates before any work
        run_dir = Path(cfg.train.run_dir)  # config.yaml and metrics.jsonl go here
        assert run_dir == expected and checkpoint_root(cfg) == expected / "checkpoints"
        assert (expected / "checkpoints").is_dir()
        assert yaml.safe_load(dump_config(cfg))["train"]["run_dir"] == str(expected)
    assert list(cwd.iterdir()) == []  # no ./~ or ./$MG_SPELL_RUNS folder


# -- keys the other settings give no effect --------------------------------------------------------------------------

GEOFP8 = str(ROOT / "configs/comm/geofp8.yaml")


@pytest.mark.parametrize(
    "preset,overrides,key,setting",
    [
        (
            None,
            ["data.train_prefix=data/train", "data.valid_prefix=data/valid", "data.tokenizer_model=tok.model"],
            "data.train_prefix=",
            "data.source=shakespeare",
        ),
        (None, ["data.valid_prefix=data/valid"], "data.valid_prefix=", "data.source=shakespeare"),
        (None, ["data.tokenizer_model=tok.model"], "data.tokenizer_model=", "data.source=shakespeare"),
        (
            None,
            [
                "data.source=indexed",
                "data.train_prefix={d}/t",
                "data.tokenizer_model={d}/t.model",
                "data.cache_dir={d}/c",
            ],
            "data.cache_dir=",
            "data.source=indexed",
        ),
        (None, ["geo.rank=16"], "geo.rank=16", "comm.transform=none"),
        (
            None,
            ["comm.dtype=fp8_e4m3", "comm.transform=hadamard", "geo.power=auto"],
            "geo.power=auto",
            "comm.transform=hadamard",
        ),
        (None, ["comm.dtype=bf16", "comm.scaling=block"], "comm.scaling=block", "comm.dtype=bf16"),
        (None, ["comm.dtype=fp8_e4m3", "comm.block_size=64"], "comm.block_size=64", "comm.scaling=tensor"),
        (None, ["comm.dtype=fp8_e4m3", "comm.hadamard_block=64"], "comm.hadamard_block=64", "comm.transform=none"),
        (None, ["optimizer.muon_momentum=0.9"], "optimizer.muon_momentum=0.9", "optimizer.name=adamw"),
        (None, ["optimizer.adamw_lr=0.01"], "optimizer.adamw_lr=0.01", "optimizer.name=adamw"),
        (
            None,
            ["parallel.distributed_optimizer=false", "parallel.overlap_param_gather=true"],
            "parallel.overlap_param_gather=true",
            "parallel.distributed_optimizer=false",
        ),
        (
            None,
            ["train.nonfinite=stop", "train.max_skipped_steps=3"],
            "train.max_skipped_steps=3",
            "train.nonfinite=stop",
        ),
        (None, ["train.device=cpu", "train.autocast_dtype=bf16"], "train.autocast_dtype=bf16", "train.device=cpu"),
        (
            GEOFP8,
            ["comm.transform=none"],
            "geo.layers=layers.*.attn",
            "comm.transform=none",
        ),  # the preset's geo keys too
        (GEOFP8, ["geo.num_layers=4"], "geo.num_layers=4", "geo.select=layers"),
        (GEOFP8, ["geo.select=gain", "geo.profile_steps=10"], "geo.profile_steps=10", "geo.select=gain"),
        (GEOFP8, ["geo.power_search=0.5,0"], "geo.power=auto", "geo.power_search=0.5,0"),
        (GEOFP8, ["geo.statistics=full", "geo.sketch_size=48"], "geo.sketch_size=48", "geo.statistics=full"),
        (
            GEOFP8,
            ["comm.error_feedback=false", "geo.ef_on_refresh=reset"],
            "geo.ef_on_refresh=reset",
            "comm.error_feedback=false",
        ),
    ],
)
def test_a_voided_key_is_an_error_unless_the_comm_preset_switched_it_off(tmp_path, preset, overrides, key, setting):
    """A comm/geo key that the chosen preset switches off is a start-up note (a sweep of presets shares one list
    of overrides); any other voided key is an error."""
    for name in ("t.bin", "t.idx", "t.model"):
        (tmp_path / name).write_bytes(b"")
    cfg = load_config(
        [TINY] + ([preset] if preset else []), [o.format(d=tmp_path) for o in overrides] + ["logging.wandb=disabled"]
    )
    validate_config(cfg, 1)
    if key.split(".")[0] in ("comm", "geo"):
        check_inputs(cfg, devices=False)
        notes = reject_inert_keys(cfg)
        assert any(n.startswith(key) and f"has no effect with {setting}" in n for n in notes), notes
        assert all(n.endswith("(recorded, not used)") for n in notes)
        return
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, devices=False)
    msg = str(e.value)
    assert msg.startswith(key) and f"has no effect with {setting}" in msg and "drop " + key.split("=")[0] in msg, msg


def test_muon_split_without_the_distributed_optimizer_is_an_error():
    cfg = load_config(
        [TINY],
        [
            "optimizer.name=muon",
            "optimizer.muon_split=2",
            "parallel.distributed_optimizer=false",
            "logging.wandb=disabled",
        ],
    )
    with pytest.raises(
        ConfigError,
        match=r"optimizer\.muon_split=2 has no effect with "
        r"parallel\.distributed_optimizer=false",
    ):
        check_inputs(cfg, devices=False)


@pytest.mark.parametrize(
    "overrides",
    [
        ["geo.rank=32", "geo.power=0.50"],  # given, but equal to the defaults: nothing is voided
        ["comm.dtype=fp8_e4m3", "comm.block_size=128", "comm.hadamard_block=128"],
        ["data.cache_dir=~/.cache/megatron_geo"],
        ["train.eval_batches=0"],  # tiny.yaml's eval_interval stays: the off switch
        ["train.lr_decay_style=constant"],  # tiny.yaml's min_lr stays
    ],
)
def test_keys_at_their_defaults_and_off_switches_pass(overrides):
    cfg = load_config([TINY], overrides + ["logging.wandb=disabled"])
    check_inputs(cfg, devices=False)


def test_the_cli_reports_a_voided_key_as_one_error_line(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "pretrain_llama.py",
            "--config",
            "configs/tiny.yaml",
            "logging.wandb=disabled",
            "data.train_prefix=data/train",
            f"train.run_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert re.search(r"data\.train_prefix=/\S*/data/train has no effect with data\.source=shakespeare", errors[0])
    assert "data.source=indexed" in errors[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


MODELS = sorted(str(p) for p in (ROOT / "configs").glob("*.yaml"))
PRESETS = sorted(str(p) for p in (ROOT / "configs" / "comm").glob("*.yaml"))
README_RUNS = [  # the combinations README and scripts/ use (files, overrides)
    ([TINY], ["train.steps=50"]),
    ([TINY], ["parallel.tensor=2"]),
    ([TINY], ["checkpoint.interval=100", "train.run_dir=runs/x"]),
    ([str(ROOT / "configs/llama_600m.yaml"), str(ROOT / "configs/comm/bf16.yaml")], []),
    ([str(ROOT / "configs/llama_600m.yaml"), GEOFP8], ["train.run_dir=runs/600m_geofp8"]),
    (
        [str(ROOT / "configs/llama_300m.yaml")],
        [
            "data.source=indexed",
            "data.train_prefix=data/train",
            "data.valid_prefix=data/valid",
            "data.tokenizer_model=tok.model",
        ],
    ),
    ([TINY, str(ROOT / "configs/comm/fp8.yaml")], ["comm.error_feedback=true"]),
]


@pytest.mark.parametrize(
    "files,overrides",
    [([f], []) for f in MODELS + PRESETS] + [([m, p], []) for m in MODELS for p in PRESETS] + README_RUNS,
)
def test_every_shipped_config_and_combination_loads_and_passes(tmp_path, files, overrides):
    from megatron_geo.training.validate import reject_inert_keys

    cfg = load_config(files, overrides)
    # a config that starts from prepared files (configs/smollm2_135m.yaml: `make smollm2`) names them when absent
    prepared = [
        v
        for v in (cfg.checkpoint.load, cfg.data.tokenizer_model if cfg.data.tokenizer_type == "huggingface" else "")
        if v and v not in ("auto", "latest", "none") and not Path(v).exists()
    ]
    if prepared:
        with pytest.raises(ConfigError, match=re.escape(prepared[0])):
            validate_config(cfg, cfg.parallel.tensor)
    else:
        validate_config(cfg, cfg.parallel.tensor)
    reject_inert_keys(cfg)
    again = load_config([_write(tmp_path, dump_config(cfg), "config.yaml")])  # a run's config.yaml lists every key
    reject_inert_keys(again)
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_a_runs_record_names_the_keys_its_preset_switched_off_and_loads_again(tmp_path):
    from megatron_geo.training.metrics import _config_record

    cfg = load_config([TINY, str(ROOT / "configs/comm/bf16.yaml")], ["geo.refresh_interval=10", "comm.block_size=64"])
    text = _config_record(cfg)
    f = tmp_path / "config.yaml"
    f.write_text(text)
    assert yaml.safe_load(text)["x-inert_keys"] == [
        "comm.block_size=64 has no effect with comm.scaling=tensor and comm.dtype=bf16 (recorded, not used)",
        "geo.refresh_interval=10 has no effect with comm.transform=none (recorded, not used)",
    ]
    again = load_config([str(f)])
    assert again.geo.refresh_interval == 10 and reject_inert_keys(again) == reject_inert_keys(cfg)
