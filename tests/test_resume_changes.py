"""What a run trains on is compared resolved on every resume: paths and environment variables as the loader
resolved them, the model's function, the wire format, GeoFP8's settings, and the training and validation files."""

from __future__ import annotations

import os
import re

import pytest

from megatron_geo.checkpoint.resume_changes import check_data_files, check_resume_changes, parse_allow_changes
from megatron_geo.config import ConfigError, config_to_dict, load_config
from megatron_geo.data import IndexedDatasetBuilder
from megatron_geo.data.identity import dataset_identity


def _cfg(*ov: str):
    return load_config([], list(ov))


def _refused(saved_ov: list[str], now_ov: list[str]) -> str:
    saved = config_to_dict(_cfg(*saved_ov))
    with pytest.raises(ConfigError) as e:
        check_resume_changes(saved, _cfg(*now_ov), 2, "resume")
    return str(e.value)


def test_a_blend_prefix_with_a_variable_is_recorded_expanded_and_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA", "/corpora/v1")
    cfg = _cfg("data.train_blend=0.5 ${DATA}/A 0.5 rel/V", "data.valid_blend=$DATA/B")
    assert cfg.data.train_blend == f"0.5 /corpora/v1/A 0.5 {tmp_path}/rel/V"
    assert cfg.data.valid_blend == "/corpora/v1/B"
    saved = config_to_dict(cfg)
    monkeypatch.setenv("DATA", "/corpora/v2")  # a requeue under another environment reaches other files
    with pytest.raises(ConfigError, match=r"data\.train_blend changed on resume: .*/corpora/v1/A.* -> .*/corpora/v2/A"):
        check_resume_changes(saved, _cfg("data.train_blend=0.5 ${DATA}/A 0.5 rel/V"), 2, "resume")


def test_the_shells_default_forms_expand_as_a_shell_would(monkeypatch, tmp_path):
    monkeypatch.setenv("SET_VAR", "/set")
    monkeypatch.setenv("EMPTY_VAR", "")
    monkeypatch.delenv("UNSET_VAR", raising=False)
    for text, want in (
        ("${SET_VAR:-/tmp}/r", "/set/r"),
        ("${UNSET_VAR:-/tmp}/r", "/tmp/r"),
        ("${EMPTY_VAR:-/d}/r", "/d/r"),
        ("${EMPTY_VAR-/d}/r", "/r"),  # set (to empty): no default
        ("${UNSET_VAR-/d}/r", "/d/r"),
    ):
        assert _cfg(f"train.run_dir={text}").train.run_dir == want, text
    with pytest.raises(ConfigError, match=r"'UNSET_VAR' is not set; set it \(export UNSET_VAR=\.\.\.\)"):
        _cfg("train.run_dir=${UNSET_VAR}/r")
    with pytest.raises(ConfigError, match=r"'\$\{SET_VAR:\?x\}' is not a variable form"):
        _cfg("train.run_dir=${SET_VAR:?x}/r")
    # a default that names a variable, as a shell expands it
    assert _cfg("train.run_dir=${UNSET_VAR:-${SET_VAR}/x}").train.run_dir == "/set/x"
    # written, but empty once expanded: never the working directory or "not given" by accident
    for key in ("train.run_dir", "data.cache_dir", "data.valid_prefix", "checkpoint.dir"):
        for text in ("${EMPTY_VAR}", "${UNSET_VAR:-}"):
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}='.*' expands to an empty path"):
                _cfg(f"{key}={text}")


def test_model_keys_that_change_the_function_are_refused_unless_allowed():
    msg = _refused([], ["model.rope_theta=500000", "model.norm_eps=1e-3"])
    assert "model.rope_theta changed on resume: 10000.0 -> 500000.0" in msg
    assert "model.norm_eps changed on resume: 1e-05 -> 0.001" in msg
    assert "checkpoint.allow_changes=model.rope_theta,model.norm_eps" in msg
    notes = check_resume_changes(
        config_to_dict(_cfg()),
        _cfg("model.rope_theta=500000", "checkpoint.allow_changes=model.rope_theta"),
        2,
        "resume",
    )
    assert any("model.rope_theta changed" in n and "allowed" in n for n in notes)


def test_the_wire_format_and_geo_settings_are_refused_unless_allowed():
    msg = _refused(["comm.dtype=fp32"], ["comm.dtype=bf16"])
    assert "comm.dtype changed on resume: 'fp32' -> 'bf16'" in msg and "numerics" in msg
    geo = ["comm.dtype=fp8_e4m3", "comm.transform=geo"]
    msg = _refused(geo, [*geo, "geo.refresh_interval=10"])
    assert "geo.refresh_interval changed on resume: 50 -> 10" in msg
    # geo keys mean nothing to a run that does not transform: not compared there
    assert check_resume_changes(config_to_dict(_cfg()), _cfg("geo.refresh_interval=10"), 2, "resume") == []
    # a whole section by its name; compile and telemetry are only logged
    notes = check_resume_changes(
        config_to_dict(_cfg(*geo)),
        _cfg("comm.dtype=fp8_e5m2", "comm.transform=geo", "geo.rank=16", "checkpoint.allow_changes=comm,geo"),
        2,
        "resume",
    )
    assert sum("allowed by checkpoint.allow_changes" in n for n in notes) == 2
    notes = check_resume_changes(config_to_dict(_cfg()), _cfg("comm.telemetry_interval=5"), 2, "resume")
    assert notes == ["comm.telemetry_interval changed on resume: 50 -> 5"]
    assert "comm.dtype" in parse_allow_changes("comm") and "geo.rank" in parse_allow_changes("geo")
    # a roll-back or an initialisation from another run starts a new trajectory: stated, not refused
    notes = check_resume_changes(config_to_dict(_cfg()), _cfg("comm.dtype=bf16"), 2, "rollback")
    assert notes == ["comm.dtype changed on resume: 'fp32' -> 'bf16' (it sets " + notes[0].split("(it sets ")[1]]


def _prefix(path, tokens):
    with IndexedDatasetBuilder(str(path), vocab_size=64) as b:
        b.add_document(tokens)
    return str(path)


def test_the_same_config_text_reaching_other_files_is_refused(tmp_path, monkeypatch):
    """A checkpoint that recorded ``${DATA}/A`` unexpanded (an earlier version) compares equal as text under any
    environment; the files it read are what tell."""
    a1 = _prefix(tmp_path / "v1" / "A", [5, 6, 7, 1])
    a2 = _prefix(tmp_path / "v2" / "A", [5, 6, 7, 1])  # the same bytes elsewhere: other files all the same
    saved_cfg = config_to_dict(_cfg("data.source=indexed"))
    saved_cfg["data"]["train_prefix"] = "${DATA}/A"
    monkeypatch.setenv("DATA", str(tmp_path / "v2"))
    now = _cfg("data.source=indexed", "data.train_prefix=${DATA}/A")
    with pytest.raises(
        ConfigError,
        match=r"the same config resolves to other files .*v1/A -> .*v2/A.*"
        r"checkpoint\.allow_changes=data\.files",
    ):
        check_data_files([dataset_identity(a1)], [dataset_identity(a2)], now, "resume", saved_cfg)
    notes = check_data_files([dataset_identity(a1)], [dataset_identity(a2)], now, "rollback", saved_cfg)
    assert len(notes) == 1 and "other files" in notes[0]


def test_validation_files_rewritten_between_launches_are_refused(tmp_path):
    v = tmp_path / "V"
    saved = [dataset_identity(_prefix(v, [5, 6, 7, 1]))]
    _prefix(v, [5, 6, 9, 9, 1])  # rewritten under the same prefix
    cfg = _cfg("data.source=indexed", f"data.valid_prefix={v}")
    with pytest.raises(ConfigError, match=r"this run.s validation loss .*idx_sha256.*data\.valid_files"):
        check_data_files(saved, [dataset_identity(str(v))], cfg, "resume", config_to_dict(cfg), "validation")
    ok = _cfg("data.source=indexed", f"data.valid_prefix={v}", "checkpoint.allow_changes=data.valid_files")
    notes = check_data_files(saved, [dataset_identity(str(v))], ok, "resume", config_to_dict(ok), "validation")
    assert len(notes) == 1 and notes[0].startswith("the validation files changed") and "allowed" in notes[0]
    # a checkpoint that did not record validation files: nothing to compare
    assert check_data_files(None, [dataset_identity(str(v))], cfg, "resume", None, "validation") == []
    assert os.path.isabs(cfg.data.valid_prefix)


def test_the_compared_comm_and_geo_keys_are_the_schemas():
    """COMM_KEYS and GEO_KEYS are read from the schema: equal to the keys listed by hand before, and a new comm key
    is compared on resume unless it is named as one that leaves the numerics alone."""
    import dataclasses

    from megatron_geo.checkpoint.resume_changes import (
        COMM_KEYS,
        COMM_UNCOMPARED,
        GEO_KEYS,
        LOGGED_KEYS,
        section_keys,
    )
    from megatron_geo.config.schema import CommConfig

    wire = "the gradient reduction's numerics (what every step's update is made of)"
    comm = (
        "dtype",
        "scaling",
        "block_size",
        "rounding",
        "error_feedback",
        "transform",
        "hadamard_block",
        "scale_sync",
        "reduce_op",
        "wire_sum_prediv",
    )
    expected_comm = {f"comm.{k}": wire for k in comm}
    expected_comm["comm.param_gather"] = "the parameters every replica computes with (the parameter all-gather)"
    assert list(COMM_KEYS.items()) == list(expected_comm.items())  # the same keys, effects and order
    geo = (
        "layers",
        "select",
        "num_layers",
        "profile_steps",
        "rank",
        "damping",
        "power",
        "power_search",
        "refresh_interval",
        "ef_on_refresh",
        "statistics",
        "sketch_size",
    )
    expected_geo = {f"geo.{k}": "GeoFP8's coordinates, hence the gradient reduction's numerics" for k in geo}
    assert list(GEO_KEYS.items()) == list(expected_geo.items())
    assert COMM_UNCOMPARED == ("compile", "label", "telemetry_interval")
    assert {f"comm.{k}" for k in COMM_UNCOMPARED} - set(LOGGED_KEYS) == {"comm.label"}  # the others are logged

    @dataclasses.dataclass
    class NewComm(CommConfig):
        new_knob: int = 0

    keys = section_keys(NewComm, "comm", wire, COMM_UNCOMPARED)
    assert keys["comm.new_knob"] == wire and "comm.compile" not in keys
