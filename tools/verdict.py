"""Noise-aware verdicts for comparing a comm mode with a reference mode over seeds (used by compare_runs.py).

The runs are paired by seed: seed k of both modes sees the same data order and initialisation, so the
per-seed difference ``d_k = loss(mode, k) - loss(reference, k)`` removes most of the seed-to-seed noise.

- ``n`` paired seeds, ``mean`` = mean of ``d``, ``sd`` = its sample standard deviation (ddof = 1).
- 95% confidence interval of the mean difference: Student t, ``mean +- t_{0.975, n-1} sd / sqrt(n)`` for
  ``n < 5``; a bootstrap (``scipy.stats.bootstrap``, BCa, 10,000 resamples, fixed seed) for ``n >= 5``.
- Verdict (lower loss is better): ``better`` if the whole interval is below 0, ``worse`` if above, else
  ``not distinguishable at n seeds``.
- ``seeds_needed``: the smallest ``n'`` with ``t_{0.975, n'-1} sd / sqrt(n') < |mean|``, i.e. how many
  paired seeds would resolve the observed gap if ``mean`` and ``sd`` stayed as measured (a planning
  figure, not a promise). Unknown (NaN) below 2 pairs: one difference has no spread to estimate from.
- A non-finite loss (NaN, inf; ``null`` in metrics.jsonl) is a diverged run: its pair is left out of the
  statistics and its seed listed (``diverged`` for the mode, ``reference_diverged`` for the reference),
  never replaced by an earlier finite value.
"""

from __future__ import annotations

import math

LEVEL = 0.95
SEEDS_LIMIT = 100_000  # seeds_needed searches up to this many paired seeds


def t_quantile(df: int, level: float = LEVEL) -> float:
    """Two-sided Student t critical value ``t_{(1+level)/2, df}`` (scipy.stats.t)."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, df))


def seeds_needed(mean: float, sd: float, level: float = LEVEL, limit: int = SEEDS_LIMIT) -> float:
    """Smallest number of paired seeds whose t interval half-width is below ``|mean|``; ``inf`` when
    ``mean == 0`` (or beyond ``limit``); 2 when ``sd == 0`` and ``mean != 0``."""
    if mean == 0 or math.isnan(mean) or math.isnan(sd):
        return math.inf
    if sd == 0:
        return 2
    n = max(2, math.ceil((1.96 * sd / abs(mean)) ** 2))  # the normal bound: t > z, so start there
    while n <= limit:
        if t_quantile(n - 1, level) * sd / math.sqrt(n) < abs(mean):
            return n
        n += 1
    return math.inf


def paired_verdict(
    mode: dict[int, float], reference: dict[int, float], level: float = LEVEL, resamples: int = 10_000, seed: int = 0
) -> dict:
    """Paired comparison of final losses ``{seed: loss}`` of a mode and a reference.

    Returns ``{"n", "mean", "sd", "lo", "hi", "method", "verdict", "seeds_needed", "diverged",
    "reference_diverged"}``: ``n`` pairs with finite losses on both sides, ``lo``/``hi`` the ``level``
    confidence interval of the mean difference mode - reference (NaN with fewer than 2 pairs),
    ``seeds_needed`` (NaN, unknown, with fewer than 2 pairs), ``diverged`` / ``reference_diverged`` the
    shared seeds whose loss is non-finite on the mode's / the reference's side (those pairs are left out).
    """
    seeds = sorted(set(mode) & set(reference))
    diverged = [s for s in seeds if not math.isfinite(mode[s])]
    ref_diverged = [s for s in seeds if not math.isfinite(reference[s])]
    d = [mode[s] - reference[s] for s in seeds if math.isfinite(mode[s]) and math.isfinite(reference[s])]
    n = len(d)
    out = {
        "n": n,
        "mean": sum(d) / n if n else math.nan,
        "sd": math.nan,
        "lo": math.nan,
        "hi": math.nan,
        "method": "none",
        "seeds_needed": math.nan,
        "diverged": diverged,
        "reference_diverged": ref_diverged,
    }
    if n < 2:
        if n == 0 and diverged and len(diverged) == len(seeds):
            out["verdict"] = f"diverged (all {len(seeds)} paired seeds)"
        else:
            out["verdict"] = f"not distinguishable (needs >= 2 paired seeds, has {n})"
        return out
    mean = out["mean"]
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    out["sd"] = sd
    if n >= 5 and sd > 0:
        import numpy as np
        from scipy import stats

        kw = dict(confidence_level=level, n_resamples=resamples, method="BCa")
        try:  # scipy >= 1.15 names the generator rng, older versions random_state
            res = stats.bootstrap((np.asarray(d),), np.mean, rng=np.random.default_rng(seed), **kw)
        except TypeError:
            res = stats.bootstrap((np.asarray(d),), np.mean, random_state=np.random.default_rng(seed), **kw)
        out["lo"], out["hi"], out["method"] = (
            float(res.confidence_interval.low),
            float(res.confidence_interval.high),
            "bootstrap",
        )
    else:
        half = t_quantile(n - 1, level) * sd / math.sqrt(n)
        out["lo"], out["hi"], out["method"] = mean - half, mean + half, "t"
    if out["hi"] < 0:
        out["verdict"] = "better"
    elif out["lo"] > 0:
        out["verdict"] = "worse"
    else:
        out["verdict"] = f"not distinguishable at {n} seeds"
    out["seeds_needed"] = seeds_needed(mean, sd, level)
    return out


def describe_seeds_needed(v: dict) -> str:
    """``seeds_needed`` of a :func:`paired_verdict` result as words: ``unknown (no pairs)`` / ``unknown (one
    pair)`` below 2 pairs (no spread to estimate from), ``never (gap 0)`` for a mean difference of exactly 0,
    ``more than 100,000`` past the search limit, else the number."""
    if v["n"] == 0:
        return "unknown (no pairs)"
    if v["n"] == 1:
        return "unknown (one pair)"
    if v["mean"] == 0:
        return "never (gap 0)"
    need = v["seeds_needed"]
    if math.isnan(need):
        return "unknown"
    return f"more than {SEEDS_LIMIT:,}" if math.isinf(need) else str(int(need))


def describe_interval(v: dict, fmt: str = "+.4f") -> str:
    """The confidence interval of a :func:`paired_verdict` result, ``[lo, hi] (method)``, or why there is none
    (``none (needs >= 2 pairs, has n)``)."""
    if v["n"] < 2:
        return f"none (needs >= 2 pairs, has {v['n']})"
    return f"[{format(v['lo'], fmt)}, {format(v['hi'], fmt)}] ({v['method']})"
