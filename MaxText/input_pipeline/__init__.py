"""The data: corpora, tokenizers, prepared token shards, and the grain pipeline that batches them."""
