"""The rows of the GeoFP8 paper's Tables I-II (GIFT, arXiv 2607.07494) next to this repository's measurement.

Table I compares coordinate systems (Euclidean, output side, input side, two-sided), Table II
approximations of the K-FAC input factor (full, diagonal, block-diagonal 32/64/128, low-rank 8/16/32), all
with the paper's whitening ``D^(1/2)`` and one-step RelL2 against the FP32 average (docs/design.md section 4).
Published values known to this project (docs/design.md section 1): Euclidean 5.28e-2 (E5M2), input
side 1.77e-2, two-sided 1.77e-2, full -66.5%, low-rank 32 -67.4%, diagonal -0.4%, block 32 -40%. Every
other cell is ``None`` ("n/a" in the table): not sourced, never filled in.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

from .report_io import fmt_value

PAPER_BLOCKS = (32, 64, 128)
PAPER_LOWRANKS = (8, 16, 32)
PAPER_EUCLIDEAN = 5.28e-2
# (paper row, label of the ablation row measuring it (``{rank}`` = the GeoFP8 rank), paper RelL2, paper change %)
PAPER_ROWS = (
    ("Euclidean", "Euclidean (baseline)", PAPER_EUCLIDEAN, 0.0),
    ("output-side", "output-side geo r{rank}", None, None),
    ("input-side", "input-side geo r{rank}", 1.77e-2, 100.0 * (1.77e-2 / PAPER_EUCLIDEAN - 1.0)),
    ("two-sided", "two-sided geo r{rank}", 1.77e-2, 100.0 * (1.77e-2 / PAPER_EUCLIDEAN - 1.0)),
    ("full", "input full (r = d_in)", None, -66.5),
    ("diagonal", "input diagonal", None, -0.4),
    ("block 32", "input block-diag 32", None, -40.0),
    ("block 64", "input block-diag 64", None, None),
    ("block 128", "input block-diag 128", None, None),
    ("low-rank 8", "input low-rank 8", None, None),
    ("low-rank 16", "input low-rank 16", None, None),
    ("low-rank 32", "input low-rank 32", None, -67.4),
)
TOLERANCE_POINTS = 10.0  # target: every row within 10 points of the paper's percentage
EUCLIDEAN_TOLERANCE = 0.15  # ... and Euclidean within 15% of 5.28e-2


def paper_rows(rows: list[dict], rank: int, scope: str = "selected") -> list[dict]:
    """One dict per paper row: ``row``, ``measured_rel_l2``, ``measured_change_pct`` (vs the Euclidean row,
    negative = lower RelL2), ``paper_rel_l2`` / ``paper_change_pct`` (None = n/a), ``diff_points`` (measured
    minus paper change, None without a paper value) and ``within`` (the issue's tolerance; None = n/a).

    Args:
        rows: evaluated ablation rows (:func:`~megatron_geo.analysis.geo_ablation.run_geo`) that include the
            paper's blocks and low ranks.
        rank: the GeoFP8 rank of the input/output/two-sided rows.
        scope: ``selected`` or ``all_linear``.

    Raises:
        KeyError: a paper row has no measured row (the ablation ran without the paper's blocks / ranks).
    """
    by_label = {r["label"]: r for r in rows}
    eu = by_label["Euclidean (baseline)"][scope]["rel_l2"]
    out = []
    for name, label, p_rel, p_pct in PAPER_ROWS:
        rel = by_label[label.format(rank=rank)][scope]["rel_l2"]
        pct = 100.0 * (rel / eu - 1.0) if eu else None
        if name == "Euclidean":
            diff = None
            within = abs(rel / PAPER_EUCLIDEAN - 1.0) <= EUCLIDEAN_TOLERANCE
        else:
            diff = pct - p_pct if p_pct is not None and pct is not None else None
            within = abs(diff) <= TOLERANCE_POINTS if diff is not None else None
        out.append(
            {
                "row": name,
                "measured_rel_l2": rel,
                "measured_change_pct": pct,
                "paper_rel_l2": p_rel,
                "paper_change_pct": p_pct,
                "diff_points": diff,
                "within": within,
            }
        )
    return out


def format_paper_table(prow: list[dict], markdown: bool = False) -> str:
    """The paper rows as a text or Markdown table (n/a where the paper's value is not sourced)."""
    head = ["paper row", "RelL2", "change %", "paper RelL2", "paper %", "diff (pts)", "within"]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    else:
        lines.append(f"{head[0]:<12} " + " ".join(f"{h:>11}" for h in head[1:]))
    for x in prow:
        vals = [
            fmt_value(x["measured_rel_l2"], ".3e"),
            fmt_value(x["measured_change_pct"], "+.1f"),
            "n/a" if x["paper_rel_l2"] is None else format(x["paper_rel_l2"], ".2e"),
            "n/a" if x["paper_change_pct"] is None else format(x["paper_change_pct"], "+.1f"),
            fmt_value(x["diff_points"], "+.1f"),
            {True: "yes", False: "NO", None: "n/a"}[x["within"]],
        ]
        if markdown:
            lines.append(f"| {x['row']} | " + " | ".join(vals) + " |")
        else:
            lines.append(f"{x['row']:<12} " + " ".join(f"{v:>11}" for v in vals))
    return "\n".join(lines)
