"""The Llama model built from tensor-parallel layers."""

from .llama import Llama, count_parameters, flops_per_token, padded_vocab_size, param_dtype

__all__ = ["Llama", "count_parameters", "flops_per_token", "padded_vocab_size", "param_dtype"]
