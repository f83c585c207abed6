"""Downstream evaluation: an lm-eval model wrapper around our Llama and the checkpoint evaluation driver.

lm-eval is imported lazily (``pip install -e .[test]`` or ``.[eval]`` installs it)."""

from .downstream import PAPER_TASKS, EvalSettings, evaluate_checkpoint, markdown, summarize

__all__ = ["PAPER_TASKS", "EvalSettings", "evaluate_checkpoint", "markdown", "summarize"]
