"""The comm presets: every ``configs/comm/<name>.yaml`` of the repository, found by listing the folder.

Tools and benchmarks take their preset lists from here, so a new preset file (a new wire format's, say) is part of
every sweep, benchmark and check without editing their code.
"""

from __future__ import annotations

from pathlib import Path

from .schema import Config

PRESET_FOLDER = Path(__file__).resolve().parents[2] / "configs" / "comm"


def comm_presets(folder: str | Path | None = None) -> dict[str, Path]:
    """``{name: path}`` of the comm presets (``<folder>/*.yaml``, default the repository's ``configs/comm``), sorted
    by name (``"fp8": .../configs/comm/fp8.yaml``); empty when the folder does not exist."""
    d = Path(folder) if folder is not None else PRESET_FOLDER
    return {p.stem: p for p in sorted(d.glob("*.yaml"))} if d.is_dir() else {}


def preset_config(name: str, folder: str | Path | None = None) -> Config:
    """The config of preset ``name`` loaded alone over the defaults (``load_config([path])``).

    Raises:
        ValueError: no such preset (the message lists them).
        ConfigError: the file does not load.
    """
    from .loader import load_config

    presets = comm_presets(folder)
    if name not in presets:
        raise ValueError(f"unknown comm preset {name!r}; choose one of {', '.join(presets)}")
    return load_config([str(presets[name])])


def codec_presets(folder: str | Path | None = None) -> list[str]:
    """The presets whose codec runs without a learned transform (``comm.transform`` none or hadamard, not geo):
    what the codec benchmarks time, by name."""
    return [n for n in comm_presets(folder) if preset_config(n, folder).comm.transform != "geo"]


def plain_presets(folder: str | Path | None = None) -> list[str]:
    """The presets that set nothing but ``comm.dtype`` (every other comm key at its default, no transform): one per
    wire format that has one (``fp32``, ``bf16``, ``fp8``, ``fp8_e5m2``, ``nvfp4`` today), by name."""
    defaults = Config().comm
    out = []
    for n in comm_presets(folder):
        c = preset_config(n, folder).comm
        if all(getattr(c, k) == getattr(defaults, k) for k in vars(defaults) if k not in ("dtype", "label")):
            out.append(n)
    return out
