"""Text and Markdown report of the ``--geo`` ablation (:mod:`.geo_ablation`): the row tables per scope,
the per-layer diagnostics and the targets.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

from .geo_ablation import GEO_FP8, PAPER_REDUCTION_PCT, TARGET_REDUCTION_PCT
from .report_io import fmt_value

_GEO_COLS = [
    ("RelL2", "rel_l2", ".3e"),
    ("gain vs E %", "rel_l2_reduction_pct", "+.1f"),
    ("layer RelL2", "mean_layer_rel_l2", ".3e"),
    ("SQNR dB", "sqnr_db", ".2f"),
    ("cosine", "cosine", ".6f"),
    ("dir top", "mean_layer_dir_err_top", ".2e"),
    ("dir tail", "mean_layer_dir_err_tail", ".2e"),
    ("tail E/geo", "tail_ratio", ".2f"),
    ("underflow", "underflow", ".2e"),
]


def format_geo_table(rows: list[dict], scope: str, markdown: bool = False) -> str:
    """One line per row of the ablation for ``scope`` (``selected`` or ``all_linear``)."""
    lines = []
    if markdown:
        lines.append("| group | coordinates | codec | " + " | ".join(c for c, _, _ in _GEO_COLS) + " |")
        lines.append("|---|---|---|" + "---:|" * len(_GEO_COLS))
    else:
        h = f"{'group':<12} {'coordinates':<34} {'codec':<16} " + " ".join(f"{c:>11}" for c, _, _ in _GEO_COLS)
        lines += [h, "-" * len(h)]
    for r in rows:
        o = r[scope]
        vals = [fmt_value(o.get(k), f) for _, k, f in _GEO_COLS]
        if markdown:
            lines.append(f"| {r['group']} | {r['label']} | {r['codec']} | " + " | ".join(vals) + " |")
        else:
            lines.append(f"{r['group']:<12} {r['label']:<34} {r['codec']:<16} " + " ".join(f"{v:>11}" for v in vals))
    return "\n".join(lines)


_DIAG_COLS = [
    ("d_in", "d_in", "d"),
    ("A top8", "a_top8_trace_frac", ".3f"),
    ("A top-r", "a_topr_trace_frac", ".3f"),
    ("A eff. rank", "a_participation_rank", ".1f"),
    ("l1/mean", "a_lambda1_over_mean", ".1f"),
    ("d_min", "d_min", ".3f"),
    ("E(g) top-r", "grad_energy_topr", ".3f"),
    ("E(g_r) top-r", "rank_grad_energy_topr", ".3f"),
    ("cancel", "rank_cancellation", ".2f"),
    ("meas. ratio", "measured_rel_l2_ratio", ".3f"),
    ("model ratio", "model_rel_l2_ratio", ".3f"),
    ("best r", "model_best_ratio_r", ".3f"),
    ("best full", "model_best_ratio_full", ".3f"),
    ("1-rank E", "roundtrip_rel_l2_euclid", ".3e"),
    ("1-rank geo", "roundtrip_rel_l2_geo", ".3e"),
    ("slope s", "slope", ".2f"),
    ("p auto", "auto_power", ".3f"),
    ("IPR", "ipr", ".3f"),
    ("cancel r", "cancel", ".2f"),
    ("pred. gain", "pred_gain", "+.3f"),
    ("white gain", "pred_gain_white", "+.3f"),
    ("sat", "sat", ".1e"),
    ("flush", "flush", ".1e"),
]


def format_diag_table(diag: list[dict], markdown: bool = False) -> str:
    if markdown:
        lines = ["| layer | " + " | ".join(c for c, _, _ in _DIAG_COLS) + " |", "|---|" + "---:|" * len(_DIAG_COLS)]
        for x in diag:
            lines.append(f"| {x['name']} | " + " | ".join(fmt_value(x[k], f) for _, k, f in _DIAG_COLS) + " |")
        return "\n".join(lines)
    h = f"{'layer':<30} " + " ".join(f"{c:>12}" for c, _, _ in _DIAG_COLS)
    lines = [h, "-" * len(h)]
    for x in diag:
        lines.append(f"{x['name']:<30} " + " ".join(f"{fmt_value(x[k], f):>12}" for _, k, f in _DIAG_COLS))
    return "\n".join(lines)


def _targets_text(tg: dict, n_sel: int, codec: str = GEO_FP8) -> str:
    red = tg["rel_l2_reduction_pct"]
    text = (
        f"targets ({tg['row']} on the {n_sel} selected layers, {codec}; reduction = RelL2 below "
        f"Euclidean, positive = better):\n"
        f"  RelL2 reduction vs Euclidean >= {TARGET_REDUCTION_PCT:.0f}% (the paper's {PAPER_REDUCTION_PCT}% is "
        f"its own regime): measured {fmt_value(red, '.1f')}% -> {'MET' if tg['reduction_met'] else 'NOT MET'}"
    )
    stale = tg.get("staleness_reduction_pct") or {}
    if stale:
        text += (
            "\n  never worse than Euclidean when applied later ("
            + ", ".join(f"t+{k}: {fmt_value(v, '+.1f')}%" for k, v in stale.items())
            + ") -> "
            + ("MET" if tg["staleness_never_worse"] else "NOT MET")
        )
    return text


def geo_report(out: dict, markdown: bool = False) -> str:
    """Text (or Markdown) report of a ``--geo`` run: targets, both tables, diagnostics."""
    g = out["geo"]
    n_sel = len(g["selected_layers"])
    st = g["settings"]
    head = (
        f"GeoFP8 coordinate ablation: {out['ranks']} ranks x {out['micro_batch_size']} samples, capture after "
        f"{out['warmup_steps']} steps (t = {g['capture_steps']['0']}); rank {st['rank']}, "
        f"damping {st['damping']:g} "
        f"x mean eigenvalue; output factor from {st['output_factor']}; transforms applied in "
        f"{st['transform_precision']}. RelL2 / SQNR / cosine: concatenated layers of the scope; layer RelL2, dir "
        f"top / tail: means over layers of the per-layer values (medians over the first / last quarter of each "
        f"gradient's singular directions); gain vs E %: RelL2 reduction against the row's Euclidean baseline (same "
        f"codec, same capture; positive = better, the opposite sign of the summary's change); "
        f"tail E/geo: baseline tail error / this row's."
    )
    sel_t = format_geo_table(g["rows"], "selected", markdown)
    all_t = format_geo_table(g["rows"], "all_linear", markdown)
    diag = format_diag_table(g["diagnostics"], markdown)
    tg = _targets_text(g["targets"], n_sel, st.get("fp8_codec", GEO_FP8))
    choices = g.get("power_search_choices") or {}
    if choices:
        sel = g["selected_layers"]
        tg += "\npowers chosen by the power search (A at t; selected layers): " + "; ".join(
            f"{k.split(' ', 1)[1]}: " + ", ".join(f"{n.removesuffix('.weight')}={v[n]:g}" for n in sel if n in v)
            for k, v in choices.items()
            if k.startswith("A@t+0 ")
        )
    diag_note = (
        "diagnostics (capture t, input side r = {r}): A top8 / top-r = share of trace(A) in the top 8 / r "
        "eigenvalues; eff. rank = trace(A)^2 / trace(A^2); l1/mean = lambda_1 / mean eigenvalue; d_min = "
        "smallest D entry; E(g) top-r = share of the averaged gradient's energy in A's top-r input "
        "directions (E(g_r): mean over ranks); cancel = RMS rank-gradient norm / norm of the average; "
        "meas. ratio = RelL2 geo / Euclidean of the layer (FP8); model ratio = sqrt(wire energy / raw energy "
        "* mean 1/d^2), that ratio if the quantization error were white in wire coordinates with energy "
        "proportional to the wire's; best r / best full = the smallest model ratio any rank-r (any "
        "full-rank) diagonal scaling in A's eigenbasis can reach (Cauchy-Schwarz over the gradient energy "
        "e_i per eigen-direction); 1-rank E / geo = one gradient quantized and dequantized "
        "(no reduce), RelL2; slope s, p auto, IPR, cancel r (in A's top-r subspace), pred. gain, sat / "
        "flush (Euclidean wire): the trainer's refresh diagnostics (megatron_geo/geometry/refresh_stats.py)."
    ).format(r=st["rank"])
    if markdown:
        return "\n\n".join(
            [
                head,
                "```\n" + tg + "\n```",
                f"**Selected layers** (`{st['layers']}`, {n_sel} layers)",
                sel_t,
                f"**All linear weights** ({len(out['layers'])} layers, every one transformed)",
                all_t,
                "**Diagnostics**: " + diag_note[len("diagnostics ") :],
                diag,
            ]
        )
    return "\n\n".join(
        [
            head,
            f"selected layers ({st['layers']}, {n_sel} layers):\n" + sel_t,
            f"all linear weights ({len(out['layers'])} layers, each transformed):\n" + all_t,
            diag_note + "\n" + diag,
            tg,
        ]
    )


def _with_spread(summary: dict, key: str, fmt: str) -> str:
    """``value [min .. max, sd, n seeds]``; where some seeds gave no finite value, how many did (the mean is
    then ``-``), and no sd from fewer than 2 values."""
    v = summary.get(key)
    s = summary.get("spread", {}).get(key)
    txt = fmt_value(v, fmt)
    seeds = len(summary.get("seeds") or []) or (s["n"] if s else 0)
    if s and s["n"] < seeds:
        txt += f" (finite in {s['n']} of {seeds} seeds)"
    if s and s["n"] > 1:
        txt += f" [{fmt_value(s['min'], fmt)} .. {fmt_value(s['max'], fmt)}, sd {s['sd']:.2g}, {s['n']} seeds]"
    return txt


def summary_report(out: dict, markdown: bool = False) -> str:
    """The ``summary`` of a ``--geo`` run as text (or Markdown): the headline changes vs Euclidean (mean and
    [min .. max, sd] over seeds), staleness, the paper's rows and the windowed metric."""
    s = out["summary"]
    params = {
        k: s[k]
        for k in ("scenario", "d_in", "d_out", "tokens", "ranks", "spike", "k", "spike_tokens", "noise", "warmup_steps")
        if k in s
    }
    lines = [
        f"summary ({', '.join(f'{k}={v}' for k, v in params.items())}; seeds {s.get('seeds')}; change = RelL2 "
        f"vs Euclidean, negative = better):",
        f"  Euclidean RelL2          {_with_spread(s, 'euclidean_rel_l2', '.3e')}",
        f"  {s.get('geo_default', 'geo default')}",
        f"  {'':<24} {_with_spread(s, 'geo_default_change_pct', '+.1f')} %",
    ]
    r = s.get("geo_rank", 32)
    for key, name in (
        ("power_auto_change_pct", f"geo.power=auto (r{r})"),
        ("power_search_change_pct", f"geo.power_search (r{r})"),
        ("paper_p05_change_pct", f"paper form (r{r}, D^1/2)"),
    ):
        if key in s:
            lines.append(f"  {name:<24} {_with_spread(s, key, '+.1f')} %")
    for k, e in (s.get("staleness") or {}).items():
        lines.append(
            f"  built at t, applied at t+{k}: Euclidean {fmt_value(e.get('euclidean_rel_l2'), '.3e')}, "
            + ", ".join(
                f"{n.removesuffix('_change_pct')} {fmt_value(v, '+.1f')} %"
                for n, v in e.items()
                if n.endswith("_change_pct")
            )
        )
    if "window" in s:
        w = s["window"]
        lines.append(
            f"  window of {w.get('K')} steps, RelL2 of the sum: "
            + ", ".join(
                f"{m} {fmt_value(w[m], '.3e')}" for m in ("euclidean", "euclidean_ef", "geo", "geo_ef") if m in w
            )
        )
    text = "\n".join(lines)
    if "paper_rows" in s:
        from .paper import format_paper_table

        table = format_paper_table(s["paper_rows"], markdown)
        text += "\n\npaper Tables I-II (D^1/2; n/a = value not sourced):\n" + table
        codec = (out.get("geo", {}).get("settings") or {}).get("fp8_codec", "")
        if s.get("scenario") != "dense-spikes" or not codec.startswith("fp8_e5m2"):
            text += (
                f"\n(the paper's values are E5M2 in its own regime, reproduced by --scenario dense-spikes "
                f"--geo-fp8-codec fp8_e5m2:tensor; this run: scenario {s.get('scenario')}, {codec or 'E4M3'})"
            )
    return "```\n" + text + "\n```" if markdown and "paper_rows" not in s else text
