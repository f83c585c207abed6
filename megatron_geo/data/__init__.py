"""Data pipeline: SentencePiece tokenizer, indexed token datasets, GPT samples, default corpus."""

from .corpus import CorpusPaths, prepare_default_corpus
from .gpt_dataset import GPTDataset, collate, dp_batch_indices
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from .tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "CorpusPaths",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "Tokenizer",
    "collate",
    "dp_batch_indices",
    "prepare_default_corpus",
    "train_tokenizer",
]
