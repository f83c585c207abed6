"""The Llama model built from tensor-parallel layers."""

from .llama import FLOPS_CONVENTION, Llama, count_parameters, flops_per_token, padded_vocab_size, param_dtype

__all__ = ["FLOPS_CONVENTION", "Llama", "count_parameters", "flops_per_token", "padded_vocab_size", "param_dtype"]
