"""Input pipeline on grain: rows of tokens -> shuffled, per-process global batches.

Every row is a dict of [max_target_length] int32 arrays, MaxText's names:
  inputs, targets (inputs shifted by one), inputs_position (position within the document),
  inputs_segmentation (document id within the row, 0 for padding), targets_segmentation
  (the loss mask: 0 where the target must not be scored).
Datasets are grain MapDatasets with random access, so the iterator's state is an index and
a restored run continues with exactly the batches it would have seen.

Text is tokenized once into a stream `doc EOD doc EOD ...`, cached as .npy, and row r is
the window stream[r*L : r*L + L + 1] (inputs and the targets one token on). Packing is done
here rather than with grain's iterator packers because windows of one stream are randomly
addressable: shuffling rows (not whole documents) and resuming at any index stay exact.
"""

import os

import grain
import jax
import numpy as np
from absl import logging

from MaxText import corpus, tokenizer as tokenizers
from MaxText.pyconfig import ConfigError


def synthetic_rows(config) -> grain.MapDataset:
  """Random tokens, one document per row; row i depends only on (data_shuffle_seed, i)."""
  length, vocab, seed = config.max_target_length, config.vocab_size, config.data_shuffle_seed

  def row(index):
    tokens = np.random.default_rng([seed, index]).integers(0, vocab, length + 1, dtype=np.int32)
    ones = np.ones(length, np.int32)
    return {"inputs": tokens[:-1], "targets": tokens[1:], "inputs_position": np.arange(length, dtype=np.int32),
            "inputs_segmentation": ones, "targets_segmentation": ones}

  return grain.MapDataset.range(2**62).map(row)


def pack(window: np.ndarray, eod: int) -> dict:
  """One row from a window of L + 1 tokens of the document stream.

  A document's tokens share a segment id (1, 2, ... within the row) and count positions
  from 0; its EOD closes it. The target after an EOD (the next document's first token) is
  not scored, so nothing is learned across a document boundary.
  """
  inputs, targets = window[:-1], window[1:]
  index = np.arange(len(inputs))
  after_eod = np.concatenate([[False], inputs[:-1] == eod])
  segments = 1 + np.cumsum(after_eod, dtype=np.int32)
  starts = np.maximum.accumulate(np.where(after_eod, index, 0))
  return {"inputs": inputs, "targets": targets, "inputs_position": (index - starts).astype(np.int32),
          "inputs_segmentation": segments, "targets_segmentation": np.where(inputs == eod, 0, segments)}


def text_rows(stream: np.ndarray, length: int, eod: int) -> grain.MapDataset:
  num_rows = (len(stream) - 1) // length
  return grain.MapDataset.range(num_rows).map(
      lambda r: pack(np.asarray(stream[r * length:r * length + length + 1], np.int32), eod))


def _tokenize_cached(config, documents, tokenizer, split) -> np.ndarray:
  """`doc EOD doc EOD ...` as int32, from dataset_cache_dir when this corpus and tokenizer
  were seen before."""
  key = tokenizers.fingerprint(documents + [tokenizer.to_str()])
  path = os.path.join(config.dataset_cache_dir, f"tokens-{split}-{key}.npy")
  if os.path.isfile(path):
    try:
      return np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:  # written atomically, so damaged after the fact
      logging.warning("token cache %s is unreadable (%s); tokenizing again", path, e)
  eod = tokenizers.eod_id(tokenizer, "tokenizer")
  encoded = tokenizer.encode_batch(documents, add_special_tokens=False)
  stream = np.fromiter((t for e in encoded for t in (*e.ids, eod)), dtype=np.int32)
  os.makedirs(config.dataset_cache_dir, exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}.npy"
  np.save(tmp, stream)
  os.replace(tmp, path)
  return np.load(path, mmap_mode="r")


class TextData:
  """The tokenizer and the tokenized train and eval streams of config.dataset_path."""

  def __init__(self, config):
    train_docs, eval_docs = corpus.split_documents(corpus.read_documents(config))
    self.tokenizer = tokenizers.load_or_train(config, train_docs)
    self.eod = tokenizers.eod_id(self.tokenizer, "tokenizer")
    self.train = _tokenize_cached(config, train_docs, self.tokenizer, "train")
    self.eval = _tokenize_cached(config, eval_docs, self.tokenizer, "eval")
    for split, stream in (("train", self.train), ("eval", self.eval)):
      if len(stream) <= config.max_target_length:
        raise ConfigError(f"dataset_path={config.dataset_path!r}: the {split} split has {len(stream)} "
                          f"tokens, fewer than one row of max_target_length={config.max_target_length}")


def batches(rows: grain.MapDataset, batch_size: int) -> grain.MapDataset:
  """This process's part of each global batch of `batch_size` rows, in order.

  Global batch s holds rows [s*G, (s+1)*G); process p of P loads the p-th of its P equal
  slices, which is the slice its devices hold once the arrays are assembled.
  """
  processes = jax.process_count()
  return rows.batch(batch_size // processes, drop_remainder=True)[jax.process_index()::processes]


def create_train_iterator(config, data: TextData | None) -> grain.DatasetIterator:
  """Endless shuffled training batches (reshuffled every epoch); checkpointable."""
  if config.dataset_type == "synthetic":
    rows = synthetic_rows(config)
  else:
    rows = text_rows(data.train, config.max_target_length, data.eod)
    rows = rows.shuffle(seed=config.data_shuffle_seed).repeat()
  return iter(batches(rows, config.global_batch_size_to_train_on).to_iter_dataset())


def create_eval_iterator(config, data: TextData | None) -> grain.DatasetIterator:
  """The same eval_steps batches of held-out rows every time (repeated if the split is short)."""
  if config.dataset_type == "synthetic":
    rows = synthetic_rows(config)[-config.eval_steps * config.micro_batch_size:]
  else:
    rows = text_rows(data.eval, config.max_target_length, data.eod).repeat()
  return iter(batches(rows, config.micro_batch_size).to_iter_dataset())
