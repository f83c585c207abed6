#!/usr/bin/env python
"""Gradient fidelity of low-precision DP reduction codecs on real or synthetic gradients (docs/design.md section 4).

A thin command over :mod:`megatron_geo.analysis` (the simulation, the scenarios, the ablation rows, the
summary, the paper rows, the windowed metric); docs/geofp8_fidelity.md has the measurements and the commands.

Codec table (default): trains the model (``configs/tiny.yaml`` unless ``--config``) for ``--warmup-steps``
steps, captures ``--ranks R`` per-rank gradients (R consecutive micro-batches, each its own backward) and
passes every linear weight's R gradients through each codec of ``--codecs``
(:func:`megatron_geo.analysis.fidelity.simulate_reduce`: per-rank scales, FP32 sum, one division by R).

    python tools/grad_fidelity.py [--config configs/tiny.yaml] [--warmup-steps 100] [--ranks 4]
        [--codecs fp8_e4m3:tensor fp8_e4m3:block128 ...] [--out runs/grad_fidelity.json] [--per-layer]
        [section.key=value ...]

``--geo`` (GeoFP8 ablation, :mod:`megatron_geo.analysis.geo_ablation`): each coordinate system (Euclidean;
input-side, output-side and two-sided GeoFP8; full, diagonal, block-diagonal, low-rank and sketched factors;
dampings; ``geo.power=auto``; ``geo.power_search``; the ``--preset``'s default; staleness; NVFP4) reduces every
layer's R gradients under ``--geo-fp8-codec`` with the ``--collective`` (``fp32``: per-rank scales and an FP32
sum, the trainer's default; ``wire_sum``: the paper's collective, one shared scale and codes summed in FP8 in
ring order, ``--wire-sum-prediv``). ``--scenario NAME`` picks the gradients: ``model`` (default; the tiny model
after ``--warmup-steps``, staleness captures at t + ``--geo-staleness``) or a synthetic scenario
(:mod:`megatron_geo.analysis.scenarios`: iid, channel-spikes, token-spikes, dense-spikes, coherent; one
``--d-in`` x ``--d-out`` layer, ``--tokens`` per rank, ``--ranks`` (default 8), ``--spike``, ``--k``,
``--spike-tokens``, ``--noise``; once per seed of ``--seeds``). ``--paper`` adds the rows of the paper's
Tables I-II (blocks 32/64/128, low ranks 8/16/32, D^(1/2)) and prints them next to the published values.
``--window K`` also carries error feedback over K consecutive steps and reports the RelL2 of the K-step sum
for Euclidean, Euclidean + EF, geo and geo + EF (geo = the preset's transform built at the first step).

    python tools/grad_fidelity.py --geo --scenario dense-spikes [--seeds 0,1,2] [--paper] [--window 10]
        [--geo-fp8-codec fp8_e5m2:tensor] [--collective wire_sum] --out F.json

JSON (``--geo``): ``{"mode": "geo", "scenario", "summary": {euclidean_rel_l2, geo_default_rel_l2,
geo_default_change_pct (negative = better), geo_default, power_auto_change_pct, power_search_change_pct,
paper_p05_change_pct, staleness {k: ...} (model), paper_rows (with --paper), window (with --window), the
scenario's parameters, seeds, spread {key: {mean, min, max, sd, n}} (several seeds)}, "runs": [{"seed",
"summary", "geo"}] (scenarios) or "geo" (model)}``; ``geo`` holds settings, capture_steps, selected_layers,
rows [{key, group, label, codec, input, output, capture, stats, baseline, selected {...}, all_linear {...},
layers [...]}], targets, diagnostics (with the trainer's refresh diagnostics: slope, auto_power, ipr,
cancel, pred_gain, sat, flush) and timings. Codec-table JSON: ``{"config_files", "overrides",
"warmup_steps", "ranks", "micro_batch_size", "device", "train_loss_first", "train_loss_last",
"capture_loss", "layers", "codecs": [{"codec", "settings", "bytes_per_element", "overall", "layers"}],
"wall_s"}``. Non-finite values are written as null. Codec specs: :mod:`megatron_geo.comm.roundtrip`.
Overrides (``section.key=value``) may also follow ``--codecs``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_geo.analysis import scenarios as SC  # noqa: E402
from megatron_geo.analysis.codec_table import bytes_per_element_of, evaluate_codec, format_table, preset_codecs  # noqa: E402
from megatron_geo.analysis.fidelity import COLLECTIVES  # noqa: E402
from megatron_geo.analysis.geo_ablation import GEO_FP8, check_geo_fp8_codec, preset_side  # noqa: E402
from megatron_geo.analysis.geo_command import run_model, run_scenario  # noqa: E402
from megatron_geo.analysis.geo_report import geo_report, summary_report  # noqa: E402
from megatron_geo.analysis.model_capture import (  # noqa: E402
    DEFAULT_CONFIG,
    capture_rank_grads,
    close_session,
    open_session,
    train_steps,
)
from megatron_geo.analysis.report_io import write_json  # noqa: E402
from megatron_geo.comm.roundtrip import normalize_codec, parse_codec  # noqa: E402
from megatron_geo.config import ConfigError  # noqa: E402
from megatron_geo.training.validate import parse_power_search  # noqa: E402

DEFAULT_CODECS = preset_codecs()  # the codec of every configs/comm preset without a learned transform


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Overrides: section.key=value, e.g. model.num_layers=2 train.seed=7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML config, repeatable, merged in order (default configs/tiny.yaml)",
    )
    p.add_argument("--warmup-steps", type=int, default=100, help="training steps before capturing (default 100)")
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="simulated DP ranks (model: micro-batches captured, default 4; scenarios: default 8)",
    )
    p.add_argument(
        "--codecs", nargs="+", default=DEFAULT_CODECS, metavar="SPEC", help="codec specs (default: %(default)s)"
    )
    p.add_argument("--out", default="runs/grad_fidelity.json", help="JSON output (default %(default)s)")
    p.add_argument("--per-layer", action="store_true", help="also print one row per layer and codec")
    p.add_argument("--no-directions", action="store_true", help="skip the per-direction error (FP64 SVDs)")
    pr = p.add_argument_group("every preset on the model (--presets)")
    pr.add_argument(
        "--presets",
        nargs="*",
        default=None,
        metavar="NAME",
        help="one-step fidelity of comm presets (configs/comm/NAME.yaml; none named: fp8, fp8_e5m2, fp8_block, "
        "fp8_hadamard, geofp8, geofp8_tensor, geofp8_paper, bf16, nvfp4, geonvfp4) on every parameter's gradient, "
        "per layer kind, vs Euclidean FP8 (fp8), plus GeoFP8 on each linear layer kind, the K-FAC spectrum and the "
        "massive activations",
    )
    g = p.add_argument_group("GeoFP8 ablation (--geo)")
    g.add_argument(
        "--geo",
        action="store_true",
        help="ablation mode: FP8 (--geo-fp8-codec, default E4M3 tensor scaling) and NVFP4 reduces in "
        "GeoFP8 coordinate systems instead of the --codecs table",
    )
    g.add_argument(
        "--geo-layers",
        default="layers.*.mlp.down_proj.weight",
        help="comma-separated globs of the GeoFP8-selected weights (default %(default)s)",
    )
    g.add_argument(
        "--geo-scope",
        default="",
        metavar="GLOBS",
        help="model: evaluate the rows on these weights only (comma-separated globs; default every linear "
        "weight), e.g. layers.*.mlp.down_proj.weight on a large model",
    )
    g.add_argument("--geo-rank", type=int, default=32, help="rank of the GeoFP8 transform (default 32)")
    g.add_argument(
        "--geo-damping",
        type=float,
        default=1e-3,
        help="damping relative to the factor's mean eigenvalue (default 1e-3)",
    )
    g.add_argument("--geo-lowranks", default="8,16,32", help="low-rank sweep (default %(default)s)")
    g.add_argument("--geo-blocks", default="32,128", help="block-diagonal block sizes (default %(default)s)")
    g.add_argument("--geo-dampings", default="1e-4,1e-3,1e-2,1e-1", help="damping sweep at --geo-rank (model)")
    g.add_argument(
        "--geo-fp8-codec",
        default=GEO_FP8,
        metavar="SPEC",
        help="codec of the FP8 rows (default %(default)s; e.g. fp8_e5m2:tensor, fp8_e4m3:block128)",
    )
    g.add_argument(
        "--geo-power-search",
        default="0.5,0.375,0.25,0.125,0",
        help="candidate powers for the geo.power_search rows (as the trainer's key; '' drops the rows)",
    )
    g.add_argument(
        "--geo-staleness",
        default="10,25,50",
        help="steps after t at which the transform built at t is applied to new gradients (model); '' "
        "skips (default %(default)s)",
    )
    g.add_argument(
        "--output-factor",
        choices=("grads", "hooks"),
        default=None,
        help="output-side factor: sum_r G_r G_r^T / (R d_in) from the weight gradients, or E[g g^T] of "
        "the output gradients (the K-FAC output factor; backward hooks on the model) (default: grads "
        "for the model, hooks for a scenario)",
    )
    g.add_argument(
        "--geo-transform-precision",
        choices=("fp64", "fp32"),
        default="fp64",
        help="apply the transforms in FP64 (only the codec loses) or in the trainer's FP32",
    )
    g.add_argument(
        "--no-investigate",
        action="store_true",
        help="skip the 'investigate' rows (D power 1/4, gradient-Gram oracle factor)",
    )
    g.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown")
    g.add_argument(
        "--collective",
        choices=COLLECTIVES,
        default="fp32",
        help="fp32: per-rank scales, FP32 sum (comm.reduce_op=fp32_sum); wire_sum: the paper's collective "
        "(one shared scale, FP8 ring sum; comm.reduce_op=wire_sum) (default %(default)s)",
    )
    g.add_argument(
        "--wire-sum-prediv",
        choices=("true", "false"),
        default="true",
        help="with --collective wire_sum: divide by N before the sum (default %(default)s)",
    )
    g.add_argument(
        "--preset",
        default="geofp8",
        help="GeoFP8 preset (configs/comm/NAME.yaml) whose settings are the summary's geo default "
        "(default %(default)s)",
    )
    g.add_argument(
        "--paper",
        action="store_true",
        help="add the paper's Table I-II rows (blocks 32/64/128, low ranks 8/16/32) and print them next "
        "to the published values",
    )
    g.add_argument(
        "--window",
        type=int,
        default=1,
        help="also report the RelL2 of the sum of K consecutive steps with and without error feedback (default 1: off)",
    )
    s = p.add_argument_group("gradients (--scenario)")
    s.add_argument(
        "--scenario",
        default="model",
        choices=("model", *SC.SCENARIOS),
        help="model: the tiny model's real gradients; else a synthetic scenario (default %(default)s)",
    )
    d = SC.ScenarioParams()
    s.add_argument("--seeds", default="0", help="comma-separated seeds of a synthetic scenario (default 0)")
    s.add_argument("--d-in", type=int, default=d.d_in, help=f"layer input size (default {d.d_in})")
    s.add_argument("--d-out", type=int, default=d.d_out, help=f"layer output size (default {d.d_out})")
    s.add_argument("--tokens", type=int, default=d.tokens, help=f"tokens per rank (default {d.tokens})")
    s.add_argument("--spike", type=float, default=d.spike, help=f"spike size (default {d.spike:g})")
    s.add_argument("--k", type=int, default=d.k, help=f"spiking channels / directions (default {d.k})")
    s.add_argument(
        "--spike-tokens",
        type=float,
        default=d.spike_tokens,
        help=f"fraction of tokens that spike in token-spikes (default {d.spike_tokens:g})",
    )
    s.add_argument("--noise", type=float, default=d.noise, help=f"noise of the coherent scenario (default {d.noise:g})")
    p.add_argument("overrides", nargs="*", help="dotted section.key=value overrides applied last")
    args = p.parse_args(argv)
    # --codecs takes one or more values, so overrides written after it land there: move them back
    args.overrides = [c for c in args.codecs if "=" in c] + args.overrides
    args.codecs = [c for c in args.codecs if "=" not in c]
    if not args.codecs:
        p.error("--codecs needs at least one codec spec")
    if args.ranks is None:
        args.ranks = 4 if args.scenario == "model" else d.ranks
    if args.output_factor is None:
        args.output_factor = "grads" if args.scenario == "model" else "hooks"
    if (args.scenario != "model" or args.paper or args.window > 1) and not args.geo:
        p.error("--scenario (other than model), --paper and --window need --geo")
    if args.presets is not None and args.geo:
        p.error("--presets and --geo are two reports; run them one at a time")
    return args


def _int_list_option(text: str, name: str, minimum: int) -> list[int]:
    """A comma-separated list of distinct integers >= ``minimum`` (raises ValueError naming ``name``)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}={text!r}: give comma-separated integers, e.g. {name} 0,1,2") from None
    bad = [v for v in vals if v < minimum]
    if bad or len(set(vals)) != len(vals):
        why = f"{bad[0]} is below {minimum}" if bad else "a value is repeated"
        raise ValueError(f"{name}={text!r}: {why}; list each value once, each >= {minimum}")
    return vals


def _check_writable(path: str, name: str) -> None:
    """Fail before minutes of computation when ``path`` cannot be written (a folder, an unwritable parent)."""
    if os.path.isdir(path):
        raise ValueError(f"{name} {path} is a folder; give a file name, e.g. {os.path.join(path, 'out.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name} {path}: cannot create its folder ({e.strerror}); choose another path") from None
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{name} {path}: its folder {parent} is not writable; choose another path")


def _check_geo_options(args) -> None:
    """Every --geo option, before any training (raises ValueError / ConfigError)."""
    parse_power_search(args.geo_power_search, "--geo-power-search")
    args.geo_fp8_codec = check_geo_fp8_codec(args.geo_fp8_codec)
    preset_side(args.preset, REPO_ROOT)
    if args.window < 1:
        raise ValueError(f"--window={args.window} must be >= 1")
    if args.geo_rank < 1:
        raise ValueError(f"--geo-rank={args.geo_rank} must be >= 1 (the rank of the K-FAC factor's approximation)")
    if not args.geo_damping > 0:
        raise ValueError(f"--geo-damping={args.geo_damping:g} must be > 0 (relative to the mean eigenvalue, e.g. 1e-3)")
    _int_list_option(args.geo_lowranks, "--geo-lowranks", 1)
    _int_list_option(args.geo_blocks, "--geo-blocks", 1)
    if args.scenario != "model":
        from megatron_geo.analysis.geo_command import scenario_params

        seeds = _int_list_option(args.seeds, "--seeds", 0)
        if not seeds:
            raise ValueError("--seeds needs at least one seed, e.g. --seeds 0,1,2")
        for seed in seeds:
            scenario_params(args, seed).check()
        if args.geo_rank > args.d_in:
            raise ValueError(f"--geo-rank={args.geo_rank} is above --d-in={args.d_in}; use a rank <= d_in")
    if args.collective == "wire_sum" and not args.geo_fp8_codec.endswith(":tensor"):
        raise ValueError("--collective wire_sum needs tensor scaling, e.g. --geo-fp8-codec fp8_e4m3:tensor")
    if args.collective != "wire_sum" and args.wire_sum_prediv != "true":
        raise ValueError("--wire-sum-prediv false only changes --collective wire_sum; add --collective wire_sum")


def _write(args, out: dict, report: str, markdown: str | None) -> None:
    print()
    print(report)
    write_json(args.out, out)
    if args.markdown and markdown is not None:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown + "\n")
    print(f"\nwrote {args.out}" + (f" and {args.markdown}" if args.markdown else "") + f" ({out['wall_s']:.1f} s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.ranks < 2 or args.warmup_steps < 0:
        print(
            f"error: --ranks={args.ranks} must be >= 2 (a reduction over DP ranks) and --warmup-steps="
            f"{args.warmup_steps} >= 0",
            file=sys.stderr,
        )
        return 2
    try:
        _check_writable(args.out, "--out")
        if args.markdown:
            _check_writable(args.markdown, "--markdown")
        specs = [(s, parse_codec(s)) for s in args.codecs]
        if args.geo:  # every --geo option is checked before the warm-up training
            _check_geo_options(args)
        if args.presets is not None:
            from megatron_geo.analysis.preset_fidelity import DEFAULT_PRESETS, preset_plan

            args.presets = args.presets or list(DEFAULT_PRESETS)
            for name in args.presets:
                preset_plan(name)  # an unknown preset is an error before the model is built
        if args.geo and args.scenario != "model":
            out = run_scenario(args)
            out["wall_s"] = time.perf_counter() - t_start
            _write(args, out, summary_report(out), summary_report(out, markdown=True))
            return 0
        sess = open_session(args.config, args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = sess.cfg
        print(
            f"model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, device {sess.pctx.device}; "
            f"training {args.warmup_steps} steps, then {args.ranks} ranks x {cfg.train.micro_batch_size} samples",
            flush=True,
        )
        t_train = time.perf_counter()
        losses = train_steps(sess, args.warmup_steps, label="warmup")
        t_train = time.perf_counter() - t_train
        if args.geo:
            return _main_geo(sess, args, losses, t_train, t_start)
        if args.presets is not None:
            return _main_presets(sess, args, losses, t_start)
        names, grads, cap_loss = capture_rank_grads(sess, args.ranks)
        grads = {n: [g.cpu() for g in gs] for n, gs in grads.items()}
        results = []
        for spec, codec in specs:
            if "seed" not in spec:
                codec = normalize_codec({**codec, "seed": cfg.train.seed})  # the reducer's Hadamard signs
            res = evaluate_codec(codec, names, grads, directions=not args.no_directions)
            results.append({"codec": spec, "settings": codec, "bytes_per_element": bytes_per_element_of(codec), **res})
    finally:
        close_session(sess)
    out = {
        "config_files": args.config or [os.path.relpath(DEFAULT_CONFIG, REPO_ROOT)],
        "overrides": args.overrides,
        "warmup_steps": args.warmup_steps,
        "ranks": args.ranks,
        "micro_batch_size": cfg.train.micro_batch_size,
        "device": str(sess.pctx.device),
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "capture_loss": cap_loss,
        "layers": [{"name": n, "shape": list(grads[n][0].shape)} for n in names],
        "codecs": results,
        "wall_s": time.perf_counter() - t_start,
    }
    report = (
        f"gradient fidelity: {len(names)} linear weights, {args.ranks} ranks, after {args.warmup_steps} steps "
        f"(capture loss {cap_loss:.4f})\n" + format_table(results, args.per_layer)
    )
    _write(args, out, report, None)
    return 0


def _run_info(args, cfg) -> dict:
    """What a report records of the run it measured: config files, overrides, warm-up, ranks, model shape."""
    return {
        "config_files": args.config or [os.path.relpath(DEFAULT_CONFIG, REPO_ROOT)],
        "overrides": args.overrides,
        "warmup_steps": args.warmup_steps,
        "ranks": args.ranks,
        "micro_batch_size": cfg.train.micro_batch_size,
        "model": {
            k: getattr(cfg.model, k)
            for k in ("hidden_size", "ffn_hidden_size", "num_layers", "seq_length", "vocab_size")
        },
    }


def _shown_path(path: str) -> str:
    """``path`` as written into a committed report: relative to the working directory when inside it (the loader
    resolves paths to absolute ones, which name the machine the report was made on), else unchanged."""
    if not path or not os.path.isabs(path):
        return path
    rel = os.path.relpath(path)
    return path if rel == ".." or rel.startswith(".." + os.sep) else rel


def _main_presets(sess, args, losses: list[float], t_start: float) -> int:
    from megatron_geo.analysis.preset_fidelity import preset_report, run_presets

    cfg = sess.cfg
    doc = run_presets(sess, args.ranks, args.presets)
    out = {
        "mode": "presets",
        **doc,
        **_run_info(args, cfg),
        "checkpoint_load": _shown_path(cfg.checkpoint.load),
        "train_loss_first": losses[0] if losses else None,
    }
    out["wall_s"] = time.perf_counter() - t_start
    _write(args, out, preset_report(out), preset_report(out, markdown=True))
    return 0


def _main_geo(sess, args, losses: list[float], t_train: float, t_start: float) -> int:
    cfg = sess.cfg
    try:
        doc = run_model(sess, args, losses)
    except ValueError as e:  # a --geo-layers pattern that matches nothing, a bad list
        print(f"error: {e}", file=sys.stderr)
        return 2
    geo = doc["geo"]
    geo["timings"]["warmup_train_s"] = t_train
    layers = [{"name": x["name"], "shape": x["shape"]} for x in geo["rows"][0]["layers"]]
    out = {
        **doc,
        **_run_info(args, cfg),
        "device": str(sess.pctx.device),
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "capture_loss": geo["capture_losses"]["0"],
        "layers": layers,
    }
    out["wall_s"] = time.perf_counter() - t_start
    _write(
        args,
        out,
        geo_report(out) + "\n\n" + summary_report(out),
        geo_report(out, markdown=True) + "\n\n" + summary_report(out, markdown=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
