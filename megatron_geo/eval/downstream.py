"""Downstream evaluation of consolidated checkpoints with lm-eval, and the summary over seeds.

``evaluate_checkpoint`` runs ``lm_eval.simple_evaluate`` on one checkpoint through
:class:`~megatron_geo.eval.lm_wrapper.MegatronGeoLM`; ``summarize`` groups the per-checkpoint scores by a
label (e.g. the comm preset) and gives, per task, the mean and sample std (ddof=1) over the group's
checkpoints (seeds) and the delta of each group's mean to the baseline group's mean.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

# The paper's 14 downstream tasks (lm-eval task names; rte is the RTE of GLUE/SuperGLUE, wsc SuperGLUE's WSC).
PAPER_TASKS = [
    "boolq",
    "cb",
    "copa",
    "multirc",
    "record",
    "rte",
    "wic",
    "wsc",
    "lambada_openai",
    "lambada_standard",
    "race",
    "mathqa",
    "piqa",
    "winogrande",
]
# Metric reported per task in the table: the first of these that the task produces.
PRIMARY_METRICS = ("acc", "f1", "em", "exact_match", "mcc")


def checkpoint_label(path: str | Path, cfg) -> str:
    """Group label of a checkpoint: the ``<label>`` of a ``<label>-seed<k>`` path component (sweep run
    folders), else the comm mode of its config (``dtype[_transform][_ef]``), or the folder's name when there
    is no training config (``cfg`` None: a Hugging Face folder)."""
    for part in reversed(Path(path).resolve().parts):
        m = re.fullmatch(r"(.+)-seed\d+", part)
        if m:
            return m.group(1)
    if cfg is None:
        return Path(path).resolve().name
    c = cfg.comm
    return c.dtype + (f"_{c.transform}" if c.transform != "none" else "") + ("_ef" if c.error_feedback else "")


def parse_results(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from lm-eval's ``results["results"]`` (keys ``"metric,filter"``; stderr
    kept as ``<metric>_stderr``; non-numeric values dropped)."""
    out = {}
    for task, vals in results.get("results", {}).items():
        m = {}
        for key, v in vals.items():
            if key == "alias" or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            name = key.split(",", 1)[0]
            m[name] = float(v)
        out[task] = m
    return out


def primary_metric(metrics: dict[str, float]) -> str | None:
    for name in PRIMARY_METRICS:
        if name in metrics:
            return name
    names = [k for k in metrics if not k.endswith("_stderr")]
    return names[0] if names else None


@dataclass(frozen=True)
class EvalSettings:
    """How :func:`evaluate_checkpoint` runs lm-eval (``tools/eval_downstream.py``'s flags of the same names).

    Attributes:
        include_path: a folder of extra task YAMLs, or None.
        include_defaults: also index lm-eval's own tasks (False: only ``include_path``'s, a faster start-up).
        num_fewshot: few-shot examples per request (None: the task's own number).
        limit: at most this many examples per task (lm-eval's ``limit``: a fraction of the task below 1), or None.
        batch_size: requests per forward pass of the model.
        device: where the model runs (``cpu``, ``cuda``, ``cuda:N``).
        seed: lm-eval's Python, NumPy, torch and few-shot seeds.
    """

    include_path: str | None = None
    include_defaults: bool = True
    num_fewshot: int | None = None
    limit: float | None = None
    batch_size: int = 8
    device: str = "cpu"
    seed: int = 1234


def evaluate_checkpoint(
    path: str, tasks: list[str], tokenizer: str | None = None, settings: EvalSettings | None = None
) -> dict:
    """Evaluate one consolidated checkpoint, or a Hugging Face folder (``tools/convert_checkpoint.py --to hf``,
    scored by lm-eval's own ``hf`` model, :mod:`.hf_lm`), on ``tasks``, lm-eval run as ``settings`` says
    (:class:`EvalSettings`; None: its defaults: lm-eval's own tasks, each task's few-shot number and every example,
    batches of 8 on the CPU, seed 1234).

    Returns ``{"checkpoint", "label", "seed", "tokenizer", "metrics": {task: {metric: value}},
    "n_samples": {task: n}}`` (``seed`` None for a Hugging Face folder). ``tokenizer`` overrides the
    SentencePiece model stored in a consolidated checkpoint (a folder: a Hugging Face tokenizer; a checkpoint of
    a run with ``data.tokenizer_type=huggingface`` uses its ``data.tokenizer_model`` folder; a Hugging Face
    model folder uses its own).
    Raises CheckpointError (bad checkpoint), ValueError (no tokenizer, --tokenizer with a Hugging Face folder,
    unknown task).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from .hf_lm import is_hf_folder, load_hf_lm

    s = settings or EvalSettings()
    batch_size, device, seed = s.batch_size, s.device, s.seed
    if is_hf_folder(path):
        if tokenizer:
            raise ValueError(
                f"--tokenizer applies to consolidated checkpoints; the Hugging Face folder '{path}' is "
                f"evaluated with its own tokenizer"
            )
        cfg, tok_path, lm = None, str(path), load_hf_lm(path, batch_size, device)
    else:
        cfg, tok_path, lm = _our_lm(path, tokenizer, batch_size, device)
    tm = TaskManager(include_path=s.include_path, include_defaults=s.include_defaults)
    known = set(tm.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ValueError(
            f"unknown lm-eval task(s) {unknown}; check the names (`lm_eval ls tasks`) or pass the "
            f"folder of your task YAML with --include-path"
        )
    res = simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=s.num_fewshot,
        limit=s.limit,
        task_manager=tm,
        log_samples=False,
        bootstrap_iters=1000,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    n = {
        t: int(v.get("effective", v.get("original", 0))) if isinstance(v, dict) else int(v)
        for t, v in (res.get("n-samples") or {}).items()
    }
    return {
        "checkpoint": str(path),
        "label": checkpoint_label(path, cfg),
        "seed": cfg.train.seed if cfg else None,
        "tokenizer": tok_path,
        "metrics": parse_results(res),
        "n_samples": n,
    }


def _our_lm(path: str, tokenizer: str | None, batch_size: int, device: str):
    """``(config, tokenizer path, MegatronGeoLM)`` of a consolidated checkpoint."""
    from ..checkpoint.consolidated import load_consolidated, tokenizer_path
    from ..data.hf_tokenizer import load_tokenizer
    from .lm_wrapper import MegatronGeoLM

    cfg, model = load_consolidated(path, device=device)
    # a folder is a Hugging Face tokenizer; a run trained with one (data.tokenizer_type=huggingface) names its folder
    if tokenizer:
        kind = "huggingface" if Path(tokenizer).is_dir() else "sentencepiece"
    else:
        kind = cfg.data.tokenizer_type
    tok_path = tokenizer or (cfg.data.tokenizer_model if kind == "huggingface" else tokenizer_path(path))
    if not tok_path:
        raise ValueError(f"checkpoint '{path}' stores no tokenizer; pass --tokenizer PATH.model")
    tok = load_tokenizer(kind, tok_path, "--tokenizer" if tokenizer else "the checkpoint's data.tokenizer_model")
    return cfg, tok_path, MegatronGeoLM(model, tok, batch_size=batch_size)


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan


def summarize(evals: list[dict], baseline: str | None = None) -> dict:
    """Per label and task: ``mean``, ``std`` (ddof=1, NaN for one checkpoint), ``n`` of the task's primary
    metric over the label's checkpoints, and ``delta`` = mean - baseline label's mean (NaN without one).

    ``baseline`` defaults to ``bf16`` if present, else the first label. Returns
    ``{"baseline", "labels", "tasks", "metric": {task: name}, "table": {label: {task: {...}}}}``.
    """
    labels = list(dict.fromkeys(e["label"] for e in evals))
    if baseline is None:
        baseline = "bf16" if "bf16" in labels else labels[0]
    tasks = list(dict.fromkeys(t for e in evals for t in e["metrics"]))
    metric = {t: primary_metric(next(e["metrics"][t] for e in evals if t in e["metrics"])) for t in tasks}
    table: dict[str, dict[str, dict]] = {}
    for lab in labels:
        table[lab] = {}
        for t in tasks:
            vals = [
                e["metrics"][t][metric[t]]
                for e in evals
                if e["label"] == lab and t in e["metrics"] and metric[t] in e["metrics"][t]
            ]
            table[lab][t] = {
                "mean": _mean(vals),
                "std": statistics.stdev(vals) if len(vals) > 1 else math.nan,
                "n": len(vals),
            }
    for lab in labels:
        for t in tasks:
            b = table.get(baseline, {}).get(t, {}).get("mean", math.nan)
            table[lab][t]["delta"] = table[lab][t]["mean"] - b
    return {"baseline": baseline, "labels": labels, "tasks": tasks, "metric": metric, "table": table}


def _f(x: float, fmt: str) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def markdown(summary: dict, evals: list[dict]) -> str:
    """Two tables: every checkpoint's primary metric per task, and per label mean ± std with the delta to
    the baseline label."""
    tasks, metric, table = summary["tasks"], summary["metric"], summary["table"]
    lines = [
        "| checkpoint | label | seed | " + " | ".join(f"{t} ({metric[t]})" for t in tasks) + " |",
        "|" + "---|" * (3 + len(tasks)),
    ]
    for e in evals:
        cells = [_f(e["metrics"].get(t, {}).get(metric[t], math.nan), ".4f") for t in tasks]
        seed = "n/a" if e["seed"] is None else e["seed"]
        lines.append(f"| {e['checkpoint']} | {e['label']} | {seed} | " + " | ".join(cells) + " |")
    b = summary["baseline"]
    lines += [
        "",
        "| task (metric) | "
        + " | ".join(f"{lab} (n={max(v['n'] for v in table[lab].values())})" for lab in summary["labels"])
        + " |",
        "|" + "---|" * (1 + len(summary["labels"])),
    ]
    for t in tasks:
        cells = []
        for lab in summary["labels"]:
            c = table[lab][t]
            cell = f"{_f(c['mean'], '.4f')} ± {_f(c['std'], '.4f')}"
            if lab != b:
                cell += f" ({_f(c['delta'], '+.4f')})"
            cells.append(cell)
        lines.append(f"| {t} ({metric[t]}) | " + " | ".join(cells) + " |")
    mean_row = []
    for lab in summary["labels"]:
        d = [table[lab][t]["delta"] for t in tasks if not math.isnan(table[lab][t]["delta"])]
        mean_row.append("" if lab == b else f"mean delta {_f(_mean(d), '+.4f')}")
    lines.append("| mean delta to " + b + " | " + " | ".join(mean_row) + " |")
    return "\n".join(lines)
