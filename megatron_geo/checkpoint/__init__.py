"""Checkpoints. ``consolidated``: one FP32 TP=1 file for evaluation and export."""

from .consolidated import load_consolidated, save_consolidated

__all__ = ["load_consolidated", "save_consolidated"]
