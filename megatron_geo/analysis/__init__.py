"""Offline analysis of gradient communication: the fidelity simulation (metrics: docs/design.md section 4), the GeoFP8
coordinate ablations, synthetic gradient scenarios, the paper's tables, the windowed error-feedback metric
and the model captures behind ``tools/grad_fidelity.py`` and ``tools/profile_fp8_vulnerability.py``.

The training path (``pretrain_llama.py``, :mod:`megatron_geo.training`, :mod:`megatron_geo.comm`,
:mod:`megatron_geo.geometry`) never imports this package (tests/test_analysis.py checks it); the one piece of
the simulation the trainer needs, one rank's codec round trip, lives in :mod:`megatron_geo.comm.roundtrip`.
"""
