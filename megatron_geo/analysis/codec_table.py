"""The codec table of ``tools/grad_fidelity.py`` (without ``--geo``): every linear weight's R gradients
through each codec (:func:`~megatron_geo.analysis.fidelity.simulate_reduce`), per layer and overall.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import torch

from ..comm.formats import comm_view, get_format
from ..comm.roundtrip import CODEC_DEFAULTS, codec_label
from ..config.presets import codec_presets, preset_config
from .fidelity import fidelity_metrics, simulate_reduce
from .report_io import finite_mean, fmt_value


def evaluate_codec(
    codec: dict, names: list[str], grads: dict[str, list[torch.Tensor]], directions: bool = True
) -> dict:
    """Per-layer and overall metrics of one codec (see the module docstring for the keys)."""
    layers, hats = [], []
    for n in names:
        g_hat = simulate_reduce(grads[n], codec)
        met = fidelity_metrics(g_hat, grads[n], codec, directions=directions)
        layers.append({"name": n, "shape": list(g_hat.shape), **met})
        hats.append(g_hat.reshape(-1))
    ranks = len(next(iter(grads.values())))
    cat = [torch.cat([grads[n][r].reshape(-1) for n in names]) for r in range(ranks)]
    overall = fidelity_metrics(torch.cat(hats), cat, None, directions=False)
    for k in ("dir_err_top", "dir_err_tail", "n_directions"):
        overall.pop(k)
    sat, el = sum(x["saturated"] for x in layers), sum(x["elements"] for x in layers)
    und, nz = sum(x["underflow_count"] for x in layers), sum(x["nonzero"] for x in layers)
    overall.update(
        saturated=sat,
        elements=el,
        saturation=sat / el if el else 0.0,
        underflow_count=und,
        nonzero=nz,
        underflow=und / nz if nz else 0.0,
        mean_layer_rel_l2=finite_mean([x["rel_l2"] for x in layers]),
        mean_layer_dir_err_top=finite_mean([x["dir_err_top"] for x in layers]),
        mean_layer_dir_err_tail=finite_mean([x["dir_err_tail"] for x in layers]),
    )
    return {"overall": overall, "layers": layers}


def preset_codecs() -> list[str]:
    """The codec specs of the ``configs/comm`` presets without a learned transform
    (:func:`megatron_geo.config.presets.codec_presets`), each once, in preset-name order, the lossless fp32
    reference left out:
    ``["bf16", "fp8_e4m3:tensor", "fp8_e4m3:block128", ...]``. Keys that are not part of a codec (error
    feedback, scale sync) do not make a new one."""
    out: list[str] = []
    for name in codec_presets():
        comm = preset_config(name).comm
        spec = codec_label({k: getattr(comm, k) for k in CODEC_DEFAULTS if hasattr(comm, k)})
        if comm.dtype != "fp32" and spec not in out:
            out.append(spec)
    return out


def bytes_per_element_of(c: dict) -> float:
    """Wire bytes per element of codec ``c`` (codes plus block scales): its format's registry entry
    (:attr:`megatron_geo.comm.formats.WireFormat.bytes_per_element`)."""
    return get_format(c["dtype"]).bytes_per_element(comm_view(c))


_COLS = [
    ("RelL2", "rel_l2", ".3e"),
    ("SQNR dB", "sqnr_db", ".2f"),
    ("cosine", "cosine", ".6f"),
    ("MaxErr", "max_err", ".2e"),
    ("sat", "saturation", ".2e"),
    ("underflow", "underflow", ".2e"),
    ("dir top", "dir_err_top", ".2e"),
    ("dir tail", "dir_err_tail", ".2e"),
]


def format_table(results: list[dict], per_layer: bool = False) -> str:
    """Readable table: one row per codec (overall), and with ``per_layer`` one block per codec."""
    head = (
        f"{'codec':<30} {'B/elem':>6} {'RelL2':>10} {'layer RelL2':>11} {'SQNR dB':>8} {'cosine':>9} "
        f"{'MaxErr':>9} {'sat':>9} {'underflow':>9} {'dir top':>9} {'dir tail':>9}"
    )
    lines = [
        "overall (RelL2/SQNR/cosine/MaxErr of the concatenated linear weights; 'layer RelL2' = mean over "
        "layers; dir top/tail = mean over layers of the per-layer medians)",
        head,
        "-" * len(head),
    ]
    for res in results:
        o = res["overall"]
        lines.append(
            f"{res['codec']:<30} {res['bytes_per_element']:>6.3f} {fmt_value(o['rel_l2'], '.3e'):>10} "
            f"{fmt_value(o['mean_layer_rel_l2'], '.3e'):>11} {fmt_value(o['sqnr_db'], '.2f'):>8} "
            f"{fmt_value(o['cosine'], '.6f'):>9} {fmt_value(o['max_err'], '.2e'):>9} "
            f"{fmt_value(o['saturation'], '.2e'):>9} "
            f"{fmt_value(o['underflow'], '.2e'):>9} {fmt_value(o['mean_layer_dir_err_top'], '.2e'):>9} "
            f"{fmt_value(o['mean_layer_dir_err_tail'], '.2e'):>9}"
        )
    if per_layer:
        for res in results:
            lines += ["", f"per layer: {res['codec']}"]
            h = f"{'layer':<34} {'shape':>11} " + " ".join(f"{c:>9}" for c, _, _ in _COLS)
            lines += [h, "-" * len(h)]
            for x in res["layers"]:
                shape = "x".join(str(s) for s in x["shape"])
                lines.append(
                    f"{x['name']:<34} {shape:>11} " + " ".join(f"{fmt_value(x[k], f):>9}" for _, k, f in _COLS)
                )
    return "\n".join(lines)
