"""The ``summary`` object of ``tools/grad_fidelity.py --geo``: the headline numbers of one evaluated
ablation, and their mean and spread over seeds.

Changes are ``100 (RelL2(row) / RelL2(Euclidean) - 1)`` against the Euclidean row of the same capture and
codec: negative = lower RelL2 than Euclidean (better).

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import math
import statistics

from .paper import EUCLIDEAN_TOLERANCE, PAPER_EUCLIDEAN, TOLERANCE_POINTS, paper_rows

# rows reported next to the default, by ablation group (the first row of the group at capture t)
COMPARED = {"power_auto": "power auto", "power_search": "power search"}


def _change(row: dict, scope: str) -> float | None:
    red = row[scope].get("rel_l2_reduction_pct")
    return None if red is None else -red


def summarize(geo: dict, scope: str, params: dict, paper: bool = False, rank: int = 32) -> dict:
    """The summary of one evaluated ablation (``geo`` from :func:`~megatron_geo.analysis.geo_ablation.run_geo`).

    Keys: ``scope``; ``euclidean_rel_l2``; ``geo_default`` (the preset's row label), ``geo_default_rel_l2``,
    ``geo_default_change_pct``; ``paper_p05_change_pct`` (input-side r = rank, D^(1/2)); for each row of
    :data:`COMPARED` present, ``<name>_change_pct``; ``staleness``: ``{k: {euclidean_rel_l2,
    geo_default_change_pct, power_auto_change_pct, power_search_change_pct}}`` (the transform built at t applied
    to the gradients of t + k); ``paper_rows`` with ``paper``; and the scenario's parameters (``params``).
    """
    rows = geo["rows"]
    by_label = {r["label"]: r for r in rows}
    eu = by_label["Euclidean (baseline)"]
    default = next((r for r in rows if r["group"] == "default" and r["capture"] == 0), None)
    out = {"scope": scope, "euclidean_rel_l2": eu[scope]["rel_l2"], "geo_rank": rank}
    if default is not None:
        out.update(
            geo_default=default["label"],
            geo_default_rel_l2=default[scope]["rel_l2"],
            geo_default_change_pct=_change(default, scope),
        )
    p05 = by_label.get(f"input-side geo r{rank}")
    if p05 is not None:
        out["paper_p05_change_pct"] = _change(p05, scope)
    for name, group in COMPARED.items():
        row = next((r for r in rows if r["group"] == group and r["capture"] == 0 and r["codec"] == eu["codec"]), None)
        if row is not None:
            out[f"{name}_change_pct"] = _change(row, scope)
    stale = {}
    for r in rows:
        k = r["capture"]
        if k == 0 or r["stats"] != 0:
            continue
        entry = stale.setdefault(str(k), {})
        entry["euclidean_rel_l2"] = by_label[f"Euclidean @ t+{k}"][scope]["rel_l2"]
        if r["group"] == "default":
            entry["geo_default_change_pct"] = _change(r, scope)
        for name, group in COMPARED.items():
            if r["group"] == group:
                entry[f"{name}_change_pct"] = _change(r, scope)
    if stale:
        out["staleness"] = stale
    if paper:
        out["paper_rows"] = paper_rows(rows, rank, scope)
    out.update(params)
    return out


def _spread(vals: list) -> dict | None:
    """``{mean, min, max, sd, n}`` over the seeds' values ``vals``; None when no value is a finite number.

    ``n`` counts the finite values. ``mean`` is None when any seed's value is missing or non-finite (a mean
    over the remaining seeds would hide that seed); ``sd`` (ddof = 1) is None below 2 finite values (one value
    has no spread to estimate from)."""
    v = [x for x in vals if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    if not v:
        return None
    return {
        "mean": sum(v) / len(v) if len(v) == len(vals) else None,
        "min": min(v),
        "max": max(v),
        "sd": statistics.stdev(v) if len(v) > 1 else None,
        "n": len(v),
    }


def aggregate(summaries: list[dict]) -> dict:
    """Mean over seeds of every number of the summaries (same keys; None where a seed's value is missing or
    non-finite), with ``spread`` ``{key: {mean, min, max, sd, n}}`` (:func:`_spread`: ``n`` finite seeds, ``sd``
    None below 2); ``paper_rows`` averaged row by row (``measured_change_pct`` / ``measured_rel_l2`` / ``diff_points``
    means, ``within`` re-judged on the means, ``change_pct_min`` / ``change_pct_max`` over seeds); ``seeds``:
    the seeds. Non-numeric values are taken from the first summary."""
    first = summaries[0]
    out, spread = {}, {}
    for key, val in first.items():
        if key in ("paper_rows", "staleness", "seed"):
            continue
        if all(x.get(key) == val for x in summaries):
            out[key] = val  # a parameter (or an identical result): kept as it is
        elif isinstance(val, (int, float)) and not isinstance(val, bool):
            s = _spread([x.get(key) for x in summaries])
            out[key] = s["mean"] if s else None
            if s and len(summaries) > 1:
                spread[key] = s
        else:
            out[key] = val
    if "staleness" in first:
        out["staleness"] = {}
        for k, entry in first["staleness"].items():
            out["staleness"][k] = {}
            for name in entry:
                s = _spread([x["staleness"][k].get(name) for x in summaries])
                out["staleness"][k][name] = s["mean"] if s else None
                if s and len(summaries) > 1:
                    spread[f"staleness.{k}.{name}"] = s
    if "paper_rows" in first:
        rows = []
        for i, row in enumerate(first["paper_rows"]):
            pct = _spread([x["paper_rows"][i]["measured_change_pct"] for x in summaries])
            rel = _spread([x["paper_rows"][i]["measured_rel_l2"] for x in summaries])
            pct_mean, rel_mean = pct["mean"] if pct else None, rel["mean"] if rel else None
            diff = (
                pct_mean - row["paper_change_pct"]
                if pct_mean is not None and row["paper_change_pct"] is not None
                else None
            )
            if row["row"] == "Euclidean":
                within = abs(rel_mean / PAPER_EUCLIDEAN - 1.0) <= EUCLIDEAN_TOLERANCE if rel_mean is not None else None
            else:
                within = abs(diff) <= TOLERANCE_POINTS if diff is not None else None
            rows.append(
                {
                    **row,
                    "measured_rel_l2": rel_mean,
                    "measured_change_pct": pct_mean,
                    "diff_points": diff,
                    "within": within,
                    "change_pct_min": pct["min"] if pct else None,
                    "change_pct_max": pct["max"] if pct else None,
                }
            )
        out["paper_rows"] = rows
    out["seeds"] = [x.get("seed") for x in summaries]
    out["spread"] = spread
    return out
