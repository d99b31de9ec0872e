"""Input pipeline on grain: rows of tokens -> shuffled, per-process global batches.

Every row is a dict of [max_target_length] int32 arrays, MaxText's names:
  inputs, targets (inputs shifted by one), inputs_position (position within the document),
  inputs_segmentation (document id within the row, 0 for padding), targets_segmentation
  (the loss mask: 0 where the target must not be scored).
Datasets are grain MapDatasets with random access, so the iterator's state is an index and
a restored run continues with exactly the batches it would have seen.
"""

import grain
import jax
import numpy as np


def synthetic_rows(config) -> grain.MapDataset:
  """Random tokens, one document per row; row i depends only on (data_shuffle_seed, i)."""
  length, vocab, seed = config.max_target_length, config.vocab_size, config.data_shuffle_seed

  def row(index, _):
    tokens = np.random.default_rng([seed, index]).integers(0, vocab, length + 1, dtype=np.int32)
    ones = np.ones(length, np.int32)
    return {"inputs": tokens[:-1], "targets": tokens[1:], "inputs_position": np.arange(length, dtype=np.int32),
            "inputs_segmentation": ones, "targets_segmentation": ones}

  return grain.MapDataset.range(2**62).map_with_index(row)


def batches(rows: grain.MapDataset, config) -> grain.MapDataset:
  """This process's part of each global batch, in order.

  Global batch s holds rows [s*G, (s+1)*G); process p of P loads the p-th of its P equal
  slices, which is the slice its devices hold once the arrays are assembled.
  """
  processes = jax.process_count()
  per_process = config.global_batch_size_to_train_on // processes
  return rows.batch(per_process, drop_remainder=True)[jax.process_index()::processes]


def create_train_iterator(config) -> grain.DatasetIterator:
  return iter(batches(synthetic_rows(config), config).to_iter_dataset())
