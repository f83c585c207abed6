#!/usr/bin/env python
"""Downstream evaluation of consolidated checkpoints with lm-eval (lm-evaluation-harness).

    python tools/eval_downstream.py CKPT.pt [CKPT.pt ...] [--tasks boolq,copa] [--out runs/eval]
    python tools/eval_downstream.py runs/sweep/*/model.pt --baseline bf16 --limit 200

CHECKPOINT: a file written by ``megatron_geo.checkpoint.save_consolidated`` (``tools/convert_checkpoint.py``
exports one from a training checkpoint). The tokenizer stored in it is used unless ``--tokenizer`` is given.
Or a Hugging Face folder (``tools/convert_checkpoint.py --to hf``), scored by lm-eval's own ``hf`` model with
the folder's tokenizer, the same requests EOS-prefixed as our wrapper does: both paths give the same
loglikelihood scores (``megatron_geo.eval.hf_lm``).
Default tasks: the paper's 14 (boolq, cb, copa, multirc, record, rte, wic, wsc, lambada_openai,
lambada_standard, race, mathqa, piqa, winogrande), zero-shot; lm-eval downloads their data from the
Hugging Face Hub on first use (or reads its cache, ``HF_DATASETS_OFFLINE=1``). ``--include-path DIR`` adds
your own task YAMLs.

Writes ``OUT/eval.json`` (every metric of every checkpoint, plus the summary) and ``OUT/eval.md``: the
primary metric (acc, else f1/em) per checkpoint and task, and per label (the ``<label>`` of a
``<label>-seed<k>`` folder in the path, else the comm mode; or ``--labels``) the mean ± std over its
checkpoints (seeds) with the delta to the baseline label. Exit status 2 for a bad checkpoint, tokenizer
or task name (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_geo.eval.downstream import PAPER_TASKS, EvalSettings, evaluate_checkpoint, markdown, summarize  # noqa: E402


def _clean(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clean(v) for v in o]
    return o


def hub_reachable(host: str = "huggingface.co", port: int = 443, timeout: float = 3.0) -> bool:
    """One TCP connect to the Hugging Face Hub with a short timeout (no retries)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def go_offline_if_unreachable() -> str | None:
    """Without a reachable Hub, set ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` (before lm-eval and datasets
    load) so cached task data is used at once and missing data fails at once, instead of a minute of Hub
    retries. Returns the note to print, or None (online, or offline already chosen by the user)."""
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return None
    if hub_reachable():
        return None
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    return "Hugging Face Hub unreachable (3 s probe): offline mode, cached task data only"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("checkpoints", nargs="+", help="consolidated checkpoint files or Hugging Face folders")
    ap.add_argument("--tasks", default=",".join(PAPER_TASKS), help="comma-separated lm-eval task names")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="SentencePiece .model, or a Hugging Face tokenizer folder (default: the checkpoint's)",
    )
    ap.add_argument("--include-path", default=None, help="folder of extra task YAMLs")
    ap.add_argument(
        "--no-default-tasks",
        action="store_true",
        help="index only --include-path tasks (faster start-up; for local tasks)",
    )
    ap.add_argument("--labels", default=None, help="comma-separated group label per checkpoint")
    ap.add_argument("--baseline", default=None, help="label the deltas are taken to (default bf16, else the first)")
    ap.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's, 0)")
    ap.add_argument("--limit", type=float, default=None, help="at most this many examples per task (testing)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="runs/eval", help="output folder for eval.json and eval.md")
    a = ap.parse_args(argv)

    from megatron_geo.checkpoint.consolidated import CheckpointError

    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    labels = a.labels.split(",") if a.labels else None
    try:
        if not tasks:
            raise ValueError("--tasks is empty; pass comma-separated lm-eval task names")
        if labels is not None and len(labels) != len(a.checkpoints):
            raise ValueError(f"--labels has {len(labels)} entries for {len(a.checkpoints)} checkpoints; give one each")
        for c in a.checkpoints:  # fail before spending time on the first one
            if not Path(c).exists():
                raise CheckpointError(
                    f"checkpoint '{c}' not found; pass a file written by save_consolidated "
                    f"(tools/convert_checkpoint.py) or a Hugging Face folder (--to hf)"
                )
        if a.tokenizer and not Path(a.tokenizer).exists():
            raise ValueError(
                f"--tokenizer '{a.tokenizer}' not found; pass the SentencePiece .model file (or the folder of a "
                f"Hugging Face tokenizer)"
            )
        note = go_offline_if_unreachable()
        if note:
            print(note, flush=True)
        evals = []
        settings = EvalSettings(
            include_path=a.include_path,
            include_defaults=not a.no_default_tasks,
            num_fewshot=a.num_fewshot,
            limit=a.limit,
            batch_size=a.batch_size,
            device=a.device,
        )
        for i, c in enumerate(a.checkpoints):
            print(f"[{i + 1}/{len(a.checkpoints)}] evaluating {c} on {len(tasks)} task(s)", flush=True)
            e = evaluate_checkpoint(c, tasks, tokenizer=a.tokenizer, settings=settings)
            if labels:
                e["label"] = labels[i]
            evals.append(e)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, OSError) as e:  # datasets: Hub unreachable / offline and not cached
        print(
            f"error: task data could not be loaded ({type(e).__name__}: {e}); run once where the Hugging Face "
            f"Hub is reachable (lm-eval caches the data under HF_DATASETS_CACHE) or use local task YAMLs with "
            f"--include-path",
            file=sys.stderr,
        )
        return 2
    summary = summarize(evals, a.baseline)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(_clean({"evaluations": evals, "summary": summary}), indent=1))
    md = markdown(summary, evals)
    (out / "eval.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out / 'eval.json'} and {out / 'eval.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
