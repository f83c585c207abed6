"""Data pipeline: SentencePiece or Hugging Face tokenizer, indexed token datasets, GPT samples (Megatron or stream
order), blends, splits, default corpus."""

from .blending import BlendedDataset, blending_index, parse_blend
from .corpus import CorpusPaths, prepare_default_corpus
from .gpt_dataset import SAMPLE_ORDERS, GPTDataset, GPTDatasetConfig, SampleDataset, collate, dp_batch_indices
from .hf_tokenizer import TOKENIZER_TYPES, HFTokenizer, load_tokenizer
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from .splits import parse_split, split_ranges
from .tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "SAMPLE_ORDERS",
    "TOKENIZER_TYPES",
    "BlendedDataset",
    "CorpusPaths",
    "GPTDataset",
    "GPTDatasetConfig",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "SampleDataset",
    "Tokenizer",
    "blending_index",
    "collate",
    "dp_batch_indices",
    "load_tokenizer",
    "parse_blend",
    "parse_split",
    "prepare_default_corpus",
    "split_ranges",
    "train_tokenizer",
]
