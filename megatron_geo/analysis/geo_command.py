"""What ``tools/grad_fidelity.py --geo`` runs: the ablation rows for the chosen gradients (a synthetic scenario
over several seeds, or the model's captures at t and t + k), the summary, the paper rows and the windowed
metric. The command only parses arguments and prints; everything it reports is built here.

``opts`` below is the tool's parsed arguments (``argparse.Namespace``); the keys used are named in the
tool's ``--help``.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import time

from ..config.schema import parse_power_search
from . import scenarios as SC
from .geo_ablation import GEO_FP4, GeoEval, GeoRows, _Transforms, geo_rows, preset_side, run_geo
from .model_capture import REPO_ROOT, Session, capture_model
from .paper import PAPER_BLOCKS, PAPER_LOWRANKS
from .summary import aggregate, summarize
from .window import windowed_rel_l2


def int_list(s: str) -> list[int]:
    """``"8,16"`` -> ``[8, 16]`` (empty parts ignored)."""
    return [int(x) for x in s.split(",") if x.strip()]


def float_list(s: str) -> list[float]:
    """``"1e-3,1e-2"`` -> ``[0.001, 0.01]`` (empty parts ignored)."""
    return [float(x) for x in s.split(",") if x.strip()]


def _setup(opts, staleness: list[int]) -> tuple[list[dict], tuple, dict]:
    """``(rows, search candidates, settings)`` of a run: the tool's rows plus the preset default, with the
    paper's blocks and low ranks under ``--paper``; a synthetic scenario drops the model-only rows (sketch,
    damping sweep, NVFP4, investigate) unless asked."""
    search = parse_power_search(opts.geo_power_search, "--geo-power-search")
    label, side, preset_search = preset_side(opts.preset, REPO_ROOT)
    if preset_search and preset_search != search:
        search = preset_search  # the default row must search the preset's own candidates
    model = opts.scenario == "model"
    blocks, lowranks = int_list(opts.geo_blocks), int_list(opts.geo_lowranks)
    if opts.paper:
        blocks = sorted(set(blocks) | set(PAPER_BLOCKS))
        lowranks = sorted(set(lowranks) | set(PAPER_LOWRANKS))
    dampings = float_list(opts.geo_dampings) if model else []
    rows = geo_rows(
        GeoRows(
            opts.geo_rank,
            opts.geo_damping,
            lowranks,
            blocks,
            dampings,
            staleness,
            investigate=model and not opts.no_investigate,
            search=search,
            sketch=64 if model else None,
            fp8=opts.geo_fp8_codec,
            default=(label, side),
            nvfp4=model,
        )
    )
    settings = {
        "layers": opts.geo_layers,
        "rank": opts.geo_rank,
        "damping": opts.geo_damping,
        "damping_is_relative": True,
        "lowranks": lowranks,
        "blocks": blocks,
        "dampings": dampings,
        "staleness": staleness,
        "output_factor": opts.output_factor,
        "power_search": list(search),
        "transform_precision": opts.geo_transform_precision,
        "fp8_codec": opts.geo_fp8_codec,
        "fp4_codec": GEO_FP4,
        "preset": opts.preset,
        "geo_default": label,
        "collective": opts.collective,
        "wire_sum_prediv": opts.wire_sum_prediv == "true",
    }
    return rows, search, settings


def _evaluation(opts, quiet: bool = False) -> GeoEval:
    """How :func:`~.geo_ablation.run_geo` evaluates the rows under the tool's options."""
    return GeoEval(
        opts.output_factor,
        not opts.no_directions,
        opts.geo_transform_precision == "fp64",
        opts.geo_rank,
        opts.geo_damping,
        opts.geo_fp8_codec,
        quiet=quiet,
        collective=(opts.collective, opts.wire_sum_prediv == "true"),
    )


def _default_transforms(caps: dict, names: list[str], side: dict, search: tuple, codec: str) -> dict:
    """The preset default's input-side transform per layer, built from capture 0 (as a refresh at t)."""
    tf = _Transforms(caps, "grads", search)
    return {n: tf.get(0, "input", n, side, codec) for n in names}


def _window(step_caps: list, names: list[str], selected: list[str], side: dict, search: tuple, codec: str) -> dict:
    """``{K, euclidean, euclidean_ef, geo, geo_ef}`` over consecutive captures ``step_caps`` (the first builds
    the transform; layers outside ``selected`` stay Euclidean in the geo modes)."""
    tf = _default_transforms({0: step_caps[0]}, selected, side, search, codec)
    layers = [([c.grads[n] for c in step_caps], tf.get(n)) for n in names]
    return {"K": len(step_caps), **windowed_rel_l2(layers, codec)}


def scenario_params(opts, seed: int, step: int = 0) -> SC.ScenarioParams:
    """The synthetic scenario of the tool's options for one seed (and step of a window)."""
    return SC.ScenarioParams(
        name=opts.scenario,
        d_in=opts.d_in,
        d_out=opts.d_out,
        tokens=opts.tokens,
        ranks=opts.ranks,
        spike=opts.spike,
        k=opts.k,
        spike_tokens=opts.spike_tokens,
        noise=opts.noise,
        seed=seed,
        step=step,
    )


def run_scenario(opts) -> dict:
    """``--geo`` on a synthetic scenario: one evaluation per seed of ``--seeds``; returns the JSON document
    (``summary`` = the mean over seeds with its spread, ``runs`` = per-seed summaries and ablations)."""
    rows0, search, settings = _setup(opts, [])
    label, side, _ = preset_side(opts.preset, REPO_ROOT)
    runs, t0 = [], time.perf_counter()
    for seed in int_list(opts.seeds):
        cap = SC.generate(scenario_params(opts, seed))
        rows = [dict(r) for r in rows0]
        scopes = {"selected": cap.names, "all_linear": cap.names}
        geo = run_geo({0: cap}, scopes, rows, search, _evaluation(opts, quiet=True))
        geo["settings"] = settings
        summ = summarize(geo, "selected", {"scenario": opts.scenario, **cap.params}, opts.paper, opts.geo_rank)
        if opts.window > 1:
            steps = [cap] + [SC.generate(scenario_params(opts, seed, k)) for k in range(1, opts.window)]
            summ["window"] = _window(steps, cap.names, cap.names, side, search, opts.geo_fp8_codec)
        runs.append({"seed": seed, "summary": summ, "geo": geo})
        print(
            f"  seed {seed}: Euclidean {summ['euclidean_rel_l2']:.3e}, "
            f"geo default {summ['geo_default_change_pct']:+.1f}%"
            f" ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    summary = aggregate([{**r["summary"], "seed": r["seed"]} for r in runs])
    if opts.window > 1:
        summary["window"] = {
            m: sum(r["summary"]["window"][m] for r in runs) / len(runs) for m in runs[0]["summary"]["window"]
        }
        summary["window"]["K"] = opts.window
    return {
        "mode": "geo",
        "scenario": opts.scenario,
        "summary": summary,
        "runs": runs,
        "wall_s": time.perf_counter() - t0,
    }


def run_model(sess: Session, opts, losses: list[float]) -> dict:
    """``--geo`` on the model: captures at t and t + k (``--geo-staleness``; with ``--window K`` also every step
    up to t + K - 1), all rows, the summary of the selected layers; returns the JSON document."""
    staleness = sorted(set(int_list(opts.geo_staleness)))
    rows, search, settings = _setup(opts, staleness)
    label, side, _ = preset_side(opts.preset, REPO_ROOT)
    selected = list(select_layers(sess, opts.geo_layers))
    caps, timings = capture_model(
        sess, opts.ranks, sorted(set(staleness) | set(range(1, max(opts.window, 1)))), opts.output_factor == "hooks"
    )
    scope = getattr(opts, "geo_scope", "")
    if scope:  # evaluate the rows on these weights only (time on a large model); the rest is dropped
        import fnmatch

        pats = [p.strip() for p in scope.split(",") if p.strip()]
        keep = [n for n in caps[0].names if any(fnmatch.fnmatchcase(n, p) for p in pats)]
        if not keep:
            raise ValueError(f"--geo-scope {scope!r} matches no linear weight; e.g. {caps[0].names[:3]}")
        for c in caps.values():
            c.names = keep
            c.grads = {n: c.grads[n] for n in keep}
            c.A = {n: c.A[n] for n in keep}
            if c.S_hooks is not None:
                c.S_hooks = {n: c.S_hooks[n] for n in keep}
    names = caps[0].names
    scopes = {"selected": [n for n in names if n in selected], "all_linear": names}
    eval_caps = {k: c for k, c in caps.items() if k == 0 or k in staleness}
    geo = run_geo(eval_caps, scopes, rows, search, _evaluation(opts))
    geo["settings"] = settings
    geo["timings"].update(timings)
    summ = summarize(
        geo,
        "selected",
        {"scenario": "model", "ranks": opts.ranks, "warmup_steps": opts.warmup_steps},
        opts.paper,
        opts.geo_rank,
    )
    if opts.window > 1:
        summ["window"] = _window(
            [caps[k] for k in range(opts.window)],
            scopes["selected"],
            scopes["selected"],
            side,
            search,
            opts.geo_fp8_codec,
        )
    summ["train_loss_first"] = losses[0] if losses else None
    return {"mode": "geo", "scenario": "model", "summary": summ, "geo": geo}


def select_layers(sess: Session, patterns: str) -> dict:
    """The GeoFP8-selected weights of the model (``--geo-layers``), as the trainer selects them."""
    from ..geometry import select_parameters

    return select_parameters(sess.model, patterns)
