"""Training loop, step, LR schedule, metrics."""

from ..optim.schedule import lr_at
from .step import StepContext, StepResult, evaluate, train_step

__all__ = ["StepContext", "StepResult", "evaluate", "lr_at", "train_step"]
