"""Comm presets that were renamed or folded into another, so the errors that refuse an old name say what to pass
now. Kept apart from the loader and the preset listing, which both name them."""

from __future__ import annotations

from pathlib import Path

# old name -> what to pass now
RENAMED_PRESETS = {"geofp8_block": "geofp8 (GeoFP8 with per-128 scales is now the default GeoFP8 preset)"}


def renamed_hint(name: str) -> str:
    """``"; preset <name> is now <new>"`` for a renamed preset (a file stem or a path to one), else ``""``."""
    stem = Path(name).stem if name.endswith((".yaml", ".yml")) else name
    new = RENAMED_PRESETS.get(stem)
    return f"; preset {stem} is now {new}" if new else ""
