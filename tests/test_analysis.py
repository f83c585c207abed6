"""megatron_geo.analysis: scenario statistics against their formulas, the windowed error-feedback metric on a
case computed by hand, the paper rows, the --scenario CLI, and that the training path never imports it."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_geo.analysis import scenarios as SC
from megatron_geo.analysis.paper import PAPER_ROWS, paper_rows
from megatron_geo.analysis.window import window_sum, windowed_rel_l2
from megatron_geo.geometry import refresh_stats as RS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(d_in=32, d_out=16, tokens=512, ranks=4, k=2)


def _eig(A):
    ev, V = torch.linalg.eigh(A.double())
    return ev.flip(0), V.flip(1)


def test_training_path_never_imports_the_analysis_package():
    code = (
        "import sys, megatron_geo.training.trainer, megatron_geo.comm.lowp, megatron_geo.geometry.geo; "
        "bad = sorted(m for m in sys.modules if m.startswith('megatron_geo.analysis')); "
        "assert not bad, bad; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_gradients_are_dY_T_X_and_the_factor_pools_all_ranks():
    p = SC.ScenarioParams(name="coherent", seed=3, **SMALL)
    cap = SC.generate(p)
    st = SC.structure(p)
    A = torch.zeros(p.d_in, p.d_in, dtype=torch.float64)
    for r in range(p.ranks):
        X, dY = SC.rank_tensors(p, r, st)
        torch.testing.assert_close(cap.grads[SC.LAYER][r], (dY.T @ X / p.tokens).float())
        A += X.T @ X
    torch.testing.assert_close(cap.A[SC.LAYER], (A / (p.ranks * p.tokens)).float())
    again = SC.generate(p)  # seeded: the same draw again
    assert all(torch.equal(a, b) for a, b in zip(cap.grads[SC.LAYER], again.grads[SC.LAYER]))


def test_iid_and_channel_spikes_factor_match_their_expectation():
    n = SMALL["ranks"] * SMALL["tokens"]
    A = SC.generate(SC.ScenarioParams(name="iid", **SMALL)).A[SC.LAYER].double()
    off = A - torch.diag(A.diagonal())
    assert abs(A.diagonal().mean().item() - 1) < 4 * math.sqrt(2 / n / SMALL["d_in"])  # E[A] = I
    assert abs(off.pow(2).mean().sqrt().item() - 1 / math.sqrt(n)) < 0.2 / math.sqrt(n)  # sampling noise only
    p = SC.ScenarioParams(name="channel-spikes", spike=30.0, **SMALL)
    A = SC.generate(p).A[SC.LAYER].double()
    ch = SC.structure(p)["channels"]
    rest = torch.ones(p.d_in, dtype=torch.bool)
    rest[ch] = False
    torch.testing.assert_close(A.diagonal()[ch], torch.full((p.k,), 900.0, dtype=torch.float64), rtol=0.1, atol=0)
    assert abs(A.diagonal()[rest].mean().item() - 1) < 0.05
    ev, V = _eig(A)
    assert V[ch, : p.k].norm().item() ** 2 == pytest.approx(p.k, rel=1e-3)  # the outliers span the spiking axes
    one = SC.generate(SC.ScenarioParams(name="channel-spikes", spike=30.0, **{**SMALL, "k": 1})).A[SC.LAYER]
    assert RS.eigvec_ipr(_eig(one)[1][:, :1].float(), torch.tensor([0.01])).item() > 0.99  # one channel: IPR 1


def test_token_spikes_outlier_direction_is_spread_over_k_channels():
    p = SC.ScenarioParams(name="token-spikes", spike=20.0, spike_tokens=1 / 32, **SMALL)
    A = SC.generate(p).A[SC.LAYER].double()
    ch = SC.structure(p)["channels"]
    u = torch.zeros(p.d_in, dtype=torch.float64)
    u[ch] = 1 / math.sqrt(p.k)
    ev, V = _eig(A)
    f = max(1, round(p.spike_tokens * p.tokens)) / p.tokens
    assert ev[0].item() == pytest.approx(1 + f * p.k * p.spike**2, rel=0.1)  # 1 + f k spike^2
    assert abs(V[:, 0] @ u).item() > 0.99
    assert RS.eigvec_ipr(V[:, :1].float(), torch.tensor([0.01])).item() == pytest.approx(1 / p.k, rel=0.05)


def test_dense_spikes_and_coherent_slopes_and_cancellation():
    p = SC.ScenarioParams(name="dense-spikes", spike=10.0, **SMALL)
    cap = SC.generate(p)
    V = SC.structure(p)["V"]
    ev, U = _eig(cap.A[SC.LAYER])
    assert ev[: p.k].mean().item() == pytest.approx(1 + p.spike**2, rel=0.1)  # 1 + spike^2
    assert (U[:, : p.k].T @ V).norm().item() ** 2 == pytest.approx(p.k, rel=0.01)  # the span of V
    assert RS.eigvec_ipr(U[:, : p.k].float(), torch.full((p.k,), 0.01)).item() < 0.2  # dense (~3 / d_in)

    def slope_and_cancel(cap):
        from megatron_geo.analysis.coordinates import build_coordinate_transform

        base = build_coordinate_transform(cap.A[SC.LAYER], "lowrank", 8, 1e-3, power=1.0)
        mom = sum(RS.layer_moments(g, base.U) for g in cap.grads[SC.LAYER])
        s = RS.energy_slope(mom[:8], mom[8], base.d, p.d_in).item()
        return s, RS.cancellation(mom[:8], mom[9:].view(-1, 8), p.ranks).item()

    s_noise, c_noise = slope_and_cancel(cap)
    s_coh, c_coh = slope_and_cancel(SC.generate(SC.ScenarioParams(name="coherent", spike=10.0, noise=0.1, **SMALL)))
    assert 0.8 < s_noise < 1.2 and 1.7 < s_coh < 2.2  # energy ~ lambda (noise), ~ lambda^2 (coherent)
    assert c_noise > 0.7 * math.sqrt(p.ranks) and c_coh < 1.1  # independent ranks vs one shared gradient


def test_scenario_parameters_are_checked():
    with pytest.raises(ValueError, match="k=40 must be <= d_in=32"):
        SC.generate(SC.ScenarioParams(name="dense-spikes", d_in=32, k=40))
    with pytest.raises(ValueError, match="scenario 'nope' is not known"):
        SC.generate(SC.ScenarioParams(name="nope"))


@pytest.mark.parametrize("s", [0.0, 0.6, 1.0, 1.6, 3.0, -1.0])
def test_auto_power_follows_the_slope_rule_on_a_known_spectrum(s):
    # A = diag(lambda) with r = 4 outliers and the rest equal; gradient energy e_i = (lambda_i + damping)^s
    # along each eigen-direction (a one-row gradient): the fitted slope is s exactly, p = clip(s / 4, 0, 1/2)
    from megatron_geo.analysis.coordinates import build_coordinate_transform

    d_in, r = 16, 4
    lam = torch.tensor([400.0, 100.0, 30.0, 5.0] + [1.0] * (d_in - r), dtype=torch.float64)
    damping = 1e-3 * lam.mean().item()
    G = (lam + damping).pow(s / 2).view(1, -1)
    base = build_coordinate_transform(torch.diag(lam), "lowrank", r, 1e-3, power=1.0)
    mom = RS.layer_moments(G.float(), base.U)
    slope = RS.energy_slope(mom[:r], mom[r], base.d, d_in).item()
    assert slope == pytest.approx(s, abs=1e-4)
    assert RS.auto_power(torch.tensor(slope)).item() == pytest.approx(min(max(s / 4, 0.0), 0.5), abs=1e-5)


def test_windowed_error_feedback_on_a_case_computed_by_hand():
    # one rank, g = [1, 0.3] every step, E4M3 tensor scaling (scale = amax / 448): 0.3 -> 134.4 -> code 128 ->
    # 0.285714; with error feedback step 2 sends 0.3 + 0.0142857 -> 140.8 -> code 144 -> 0.321429
    g = torch.tensor([[1.0, 0.3]])
    steps = [[g], [g]]
    norm = 2 * math.sqrt(1.09)
    got, want = window_sum(steps, "fp8_e4m3:tensor")
    torch.testing.assert_close(got, torch.tensor([[2.0, 2 * 128 / 448]], dtype=torch.float64), rtol=0, atol=1e-7)
    got_ef, _ = window_sum(steps, "fp8_e4m3:tensor", error_feedback=True)
    torch.testing.assert_close(
        got_ef, torch.tensor([[2.0, 128 / 448 + 144 / 448]], dtype=torch.float64), rtol=0, atol=1e-7
    )
    rel = windowed_rel_l2([(steps, None)], "fp8_e4m3:tensor")
    assert rel["euclidean"] == pytest.approx(2 * (0.3 - 128 / 448) / norm, rel=1e-5)
    assert rel["euclidean_ef"] == pytest.approx(abs(0.6 - 128 / 448 - 144 / 448) / norm, rel=1e-5)
    assert rel["geo"] == rel["euclidean"] and rel["geo_ef"] == rel["euclidean_ef"]  # no transform: Euclidean
    assert window_sum([[g]], "fp8_e4m3:tensor", error_feedback=True)[0].equal(got[:1] / 2)  # K = 1: EF changes nothing


def test_paper_rows_compare_only_sourced_values():
    labels = [lab.format(rank=32) for _, lab, _, _ in PAPER_ROWS]
    rows = [
        {"label": lab, "selected": {"rel_l2": 5e-2 * (0.3 if "low-rank" in lab or "input-side" in lab else 1.0)}}
        for lab in labels
    ]
    rows[0]["selected"]["rel_l2"] = 5.0e-2
    out = {x["row"]: x for x in paper_rows(rows, 32)}
    assert out["Euclidean"]["within"] is True  # 5.0e-2 is within 15% of 5.28e-2
    assert out["low-rank 32"]["measured_change_pct"] == pytest.approx(-70.0)
    assert out["low-rank 32"]["diff_points"] == pytest.approx(-70.0 + 67.4) and out["low-rank 32"]["within"]
    assert out["full"]["diff_points"] == pytest.approx(0.0 + 66.5) and out["full"]["within"] is False
    assert out["block 64"]["paper_change_pct"] is None and out["block 64"]["within"] is None  # n/a, not invented


def test_grad_fidelity_scenario_cli_writes_the_summary(tmp_path):
    out = tmp_path / "s.json"
    r = subprocess.run(
        [
            sys.executable,
            "tools/grad_fidelity.py",
            "--geo",
            "--scenario",
            "dense-spikes",
            "--d-in",
            "32",
            "--d-out",
            "16",
            "--tokens",
            "128",
            "--ranks",
            "2",
            "--k",
            "2",
            "--spike",
            "100",
            "--seeds",
            "0,1",
            "--paper",
            "--window",
            "2",
            "--geo-rank",
            "4",
            "--no-directions",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "paper Tables I-II" in r.stdout and "n/a" in r.stdout
    s = json.loads(out.read_text())["summary"]
    for key in (
        "euclidean_rel_l2",
        "geo_default_rel_l2",
        "geo_default_change_pct",
        "power_auto_change_pct",
        "power_search_change_pct",
    ):
        assert isinstance(s[key], float), key
    assert s["geo_default_change_pct"] == pytest.approx(
        100 * (s["geo_default_rel_l2"] / s["euclidean_rel_l2"] - 1), abs=2.0
    )  # means over 2 seeds: ratio of means ~ mean ratio
    assert s["scenario"] == "dense-spikes" and s["d_in"] == 32 and s["seeds"] == [0, 1] and s["spike"] == 100.0
    assert len(s["paper_rows"]) == len(PAPER_ROWS) and set(s["window"]) == {
        "K",
        "euclidean",
        "euclidean_ef",
        "geo",
        "geo_ef",
    }
    assert set(s["spread"]["euclidean_rel_l2"]) == {"mean", "min", "max", "sd", "n"}


def test_wire_sum_collective_is_the_ring_simulation_in_euclidean_coordinates():
    from megatron_geo.analysis.fidelity import geo_reduce_and_metrics
    from megatron_geo.comm.wire_sum import simulate_wire_sum

    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(8, 16, generator=gen) * (1 + r) for r in range(3)]
    for prediv in (True, False):
        hat, m = geo_reduce_and_metrics(grads, "fp8_e4m3:tensor", collective="wire_sum", prediv=prediv)
        ref, hits = simulate_wire_sum(grads, "fp8_e4m3", prediv)
        assert torch.equal(hat, ref) and m["wire_sum_saturated"] == hits["saturated"]
    fp32 = geo_reduce_and_metrics(grads, "fp8_e4m3:tensor")[1]
    assert "wire_sum_saturated" not in fp32 and fp32["rel_l2"] < m["rel_l2"]  # per-rank scales + FP32 sum win
    with pytest.raises(ValueError, match="tensor scaling"):
        geo_reduce_and_metrics(grads, "fp8_e4m3:block8", collective="wire_sum")


def test_grad_fidelity_bad_options_are_one_error_line_before_any_work(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("grad_fidelity_cli", os.path.join(REPO, "tools/grad_fidelity.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    base = [
        "--geo",
        "--scenario",
        "iid",
        "--d-in",
        "16",
        "--d-out",
        "8",
        "--tokens",
        "32",
        "--ranks",
        "2",
        "--geo-rank",
        "4",
        "--out",
        str(tmp_path / "s.json"),
    ]
    cases = [
        (["--geo-rank", "0"], "--geo-rank=0 must be >= 1"),
        (["--geo-rank", "64"], "--geo-rank=64 is above --d-in=16"),
        (["--seeds", "0,0"], "a value is repeated"),
        (["--seeds", "a,b"], "--seeds='a,b': give comma-separated integers"),
        (["--geo-blocks", "0"], "--geo-blocks='0': 0 is below 1"),
        (["--geo-damping", "-1"], "--geo-damping=-1 must be > 0"),
        (["--wire-sum-prediv", "false"], "--wire-sum-prediv false only changes --collective wire_sum"),
        (["--preset", "geonvfp4"], "preset 'geonvfp4' sends nvfp4; --preset takes an FP8 GeoFP8 preset"),
        (["--out", str(tmp_path)], "is a folder; give a file name"),
        (["--ranks", "1"], "--ranks=1 must be >= 2"),
    ]
    for extra, want in cases:
        capsys.readouterr()
        assert tool.main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], (extra, err)
    assert not (tmp_path / "s.json").exists()  # nothing was computed or written
