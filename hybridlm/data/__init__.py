"""Data layer: fetched assets, text -> packed token shards, and resumable rank-sharded batches."""
from hybridlm.data.assets import AssetError, cache_dir, corpus_path, load_tokenizer, resolve_source, tokenizer_path
from hybridlm.data.config import DataConfig
from hybridlm.data.packed import PackedBatches, PackedTokens, open_splits, read_meta, validation_batches
from hybridlm.data.prepare import ensure_prepared, iter_documents, prepare, token_dtype

__all__ = [
    "AssetError", "DataConfig", "PackedBatches", "PackedTokens", "cache_dir", "corpus_path", "ensure_prepared",
    "iter_documents", "load_tokenizer", "open_splits", "prepare", "read_meta", "resolve_source", "token_dtype",
    "tokenizer_path", "validation_batches",
]
