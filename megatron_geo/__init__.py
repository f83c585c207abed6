"""megatron-geo: Megatron-style TP x DP Llama pretraining with pluggable low-precision gradient reduction."""

__version__ = "0.1.0"
