"""Data: tokenizers, the built-in corpus, local datasets, document packing, per-rank batches."""
