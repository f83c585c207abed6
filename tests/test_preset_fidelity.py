"""tools/grad_fidelity.py --presets: every preset's one-step RelL2 per layer kind, checked against torch's own casts
(BF16, E4M3 with one scale per parameter) on the tiny model's real gradients, the GeoFP8 presets equal to
Euclidean FP8 outside the layers they transform, and the K-FAC spectrum against torch.linalg.eigvalsh."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from helpers import load_tool
from megatron_geo.analysis.preset_fidelity import kind_of, preset_plan, run_presets

ROOT = Path(__file__).resolve().parents[1]


def test_layer_kinds_and_preset_plans():
    assert kind_of("layers.3.mlp.down_proj.weight") == "down"
    assert kind_of("layers.0.attn.k_proj.weight") == "k"
    assert [kind_of(n) for n in ("embed.weight", "output.weight", "norm.weight")] == ["embedding", "output", "norm"]
    assert kind_of("layers.0.attn_norm.weight") == "other"
    assert preset_plan("geofp8")["geo"]["power"] == "auto" and preset_plan("geofp8_paper")["geo"]["power"] == 0.5
    assert preset_plan("fp8_hadamard")["codec"]["transform"] == "hadamard" and preset_plan("fp8")["geo"] is None
    with pytest.raises(ValueError, match="shares its scales"):
        preset_plan("fp8_shared_scale")
    with pytest.raises(ValueError, match="not found|no preset|unknown"):
        preset_plan("fp9")


def _torch_reference(grads: dict, names: list[str], cast) -> float:
    """Whole RelL2 of the mean of ``cast(g_r)`` against the FP64 mean, over ``names``."""
    err = ref = 0.0
    for n in names:
        g = torch.stack([x.double() for x in grads[n]]).mean(0)
        hat = torch.stack([cast(x) for x in grads[n]]).sum(0).div(len(grads[n])).double()
        err += float((hat - g).square().sum())
        ref += float(g.square().sum())
    return math.sqrt(err / ref)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().max().clamp(min=1e-30) / 448.0
    return (x / s).to(torch.float8_e4m3fn).float() * s


def test_relative_errors_match_torch_casts_on_the_tiny_model(monkeypatch):
    from megatron_geo.analysis import preset_fidelity
    from megatron_geo.analysis.model_capture import close_session, open_session

    captured = {}
    real = preset_fidelity.capture_all

    def keep(sess, ranks):
        out = real(sess, ranks)
        captured["grads"], captured["A"] = out[1], out[0].A
        return out

    monkeypatch.setattr(preset_fidelity, "capture_all", keep)
    sess = open_session([str(ROOT / "configs" / "tiny.yaml")], ["model.num_layers=2", "logging.wandb=disabled"])
    try:
        doc = run_presets(
            sess,
            2,
            ["bf16", "fp8_block", "geofp8_paper", "geofp8_tensor", "geofp8"],
            candidates=False,
            log=lambda m: None,
        )
    finally:
        close_session(sess)
    grads = captured["grads"]
    names = list(grads)
    fp8, bf16, paper, geo = (doc["presets"][p]["rel_l2"] for p in ("fp8", "bf16", "geofp8_paper", "geofp8_tensor"))
    block, geo_block = (doc["presets"][p]["rel_l2"] for p in ("fp8_block", "geofp8"))
    assert bf16["whole"] == pytest.approx(_torch_reference(grads, names, lambda x: x.bfloat16().float()), rel=1e-6)
    down = [n for n in names if kind_of(n) == "down"]
    assert fp8["down"] == pytest.approx(_torch_reference(grads, down, _e4m3), rel=1e-6)
    assert fp8["whole"] == pytest.approx(_torch_reference(grads, names, _e4m3), rel=1e-6)
    # geofp8_paper transforms the down projections only: every other kind is Euclidean FP8 bit for bit
    for k in ("q", "k", "v", "o", "gate", "up", "embedding", "output"):
        assert paper[k] == fp8[k], k
    assert doc["presets"]["geofp8_paper"]["transformed_layers"] == len(down)
    summary = doc["summary"]["geofp8_paper"]
    assert summary["transformed_change_pct"] == pytest.approx(100 * (paper["down"] / fp8["down"] - 1))
    # geofp8(_tensor) take every linear weight; the embedding and the norms are never transformed, so they are
    # sent as the same format without geometry: fp8 for geofp8_tensor, fp8_block (per-128 scales) for geofp8
    linear = [n for n in names if kind_of(n) in ("q", "k", "v", "o", "gate", "up", "down", "output")]
    assert doc["presets"]["geofp8_tensor"]["transformed_layers"] == len(linear)
    assert doc["presets"]["geofp8"]["transformed_layers"] == len(linear)
    assert (geo["embedding"], geo["norm"]) == (fp8["embedding"], fp8["norm"])
    assert (geo_block["embedding"], geo_block["norm"]) == (block["embedding"], block["norm"])
    # the spectrum's share of trace in the top 32 eigenvalues, for one down projection
    a = captured["A"][down[0]].double()
    ev = torch.linalg.eigvalsh(a).flip(0)
    top = float(ev[:32].sum() / ev.sum())
    assert doc["spectrum"]["down"]["rank_energy"]["min"] <= top + 1e-9
    assert doc["spectrum"]["down"]["rank_energy"]["max"] >= top - 1e-9


def test_an_unknown_preset_is_refused_before_the_model_is_built(tmp_path, capsys):
    assert load_tool("grad_fidelity").main(["--presets", "fp8", "nope", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_report_paths_name_no_machine(tmp_path, monkeypatch):
    """A path the loader made absolute is written relative to the working directory, outside it unchanged."""
    shown = load_tool("grad_fidelity")._shown_path
    monkeypatch.chdir(tmp_path)
    assert shown(str(tmp_path / "runs" / "init")) == os.path.join("runs", "init")
    assert shown("runs/init") == "runs/init" and shown("") == ""
    outside = str(tmp_path.parent / "elsewhere")
    assert shown(outside) == outside
