"""prepare_data as an Apache Beam pipeline (runner=DirectRunner, DataflowRunner, FlinkRunner, ...).

It writes the shards the local path writes: the same documents (corpus.records), the same
held-out rule (corpus.split_position, given each file's first global position from a count
per file), the same tokenizer, and document k of a split as record k // N of shard k % N.
Files are read one per worker, documents tokenized anywhere, and each shard is written by one
worker after a GroupByKey on (split, shard). Apache Beam pins older protobuf, pillow and
python-dateutil than this project's venv, so setup.sh installs it apart into .venv/beam:
run with PYTHONPATH=.venv/beam.
"""

import shlex

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions

from MaxText import errors
from MaxText.input_pipeline import corpus, token_shards

_NAMESPACE = "prepare_data"


def _read(indexed_path, text_column: str, strict: bool):
  """((file, position in file), document) of one file; bad records only counted."""
  file_index, path = indexed_path
  position = 0
  for record, _ in corpus.records(path, text_column):
    if isinstance(record, str) and not record.strip():
      record = corpus.BadRecord("empty document", f"dataset_path: {path} has an empty document")
    if isinstance(record, corpus.BadRecord):
      if strict:
        raise errors.ConfigError(f"{record.message} (strict_data=true)")
      beam.metrics.Metrics.counter(_NAMESPACE, record.kind).inc()
      continue
    yield (file_index, position), record
    position += 1


def _layout(counts):
  """{"starts": first global position of each file's documents, "total": documents}."""
  starts, total = {}, 0
  for file_index, count in sorted(counts):
    starts[file_index] = total
    total += count
  return {"starts": starts, "total": total}


def _place(element, layout, shards: dict):
  """((split, shard), (record index, document)) by the local path's rule."""
  (file_index, position), document = element
  if layout["total"] == 1:
    train, held_out = corpus.split_documents([document])
    placed = [("train", 0, train[0]), ("eval", 0, held_out[0])]
  else:
    placed = [(*corpus.split_position(layout["starts"][file_index] + position, layout["total"]), document)]
  for split, k, text in placed:
    yield (split, k % shards[split]), (k // shards[split], text)


class _Tokenize(beam.DoFn):

  def __init__(self, tokenizer_json: str):
    self._json = tokenizer_json

  def setup(self):
    from tokenizers import Tokenizer  # noqa: PLC0415 (on the worker)
    self._tokenizer = Tokenizer.from_str(self._json)

  def process(self, element):
    key, (index, text) = element
    yield key, (index, self._tokenizer.encode(text, add_special_tokens=False).ids)


def _write_shard(element, directory: str, shards: dict):
  (split, shard), documents = element
  writer = token_shards.ShardWriter(f"{directory}/{token_shards.shard_name(split, shard, shards[split])}")
  for _, ids in sorted(d for d in documents if d is not None):
    writer.add(ids)
  writer.close()


def run(config, tokenizer, paths, partial: str, bad) -> int:
  """Runs the pipeline on config.runner, writing the shards into `partial`; returns the tokens
  written and adds the bad records the workers counted to `bad`."""
  shards = {"train": config.num_train_shards, "eval": config.num_eval_shards}
  options = PipelineOptions([f"--runner={config.runner}", *shlex.split(config.beam_pipeline_options)])
  pipeline = beam.Pipeline(options=options)
  documents = (pipeline | "files" >> beam.Create(list(enumerate(paths)))
               | "read" >> beam.FlatMap(_read, config.text_column, config.strict_data))
  layout = (documents | "file of each" >> beam.Map(lambda element: element[0][0])
            | "count per file" >> beam.combiners.Count.PerElement() | beam.combiners.ToList()
            | "layout" >> beam.Map(_layout))
  # Every shard gets a group, so shards with no documents are written too (empty).
  empty = pipeline | "all shards" >> beam.Create([((split, i), None) for split, n in shards.items() for i in range(n)])
  placed = (documents | "place" >> beam.FlatMap(_place, beam.pvalue.AsSingleton(layout), shards)
            | "tokenize" >> beam.ParDo(_Tokenize(tokenizer.to_str())))
  _ = ((placed, empty) | beam.Flatten() | beam.GroupByKey()
       | "write" >> beam.Map(_write_shard, partial, shards))
  try:
    result = pipeline.run()
    result.wait_until_finish()
  except Exception as e:  # a runner wraps what a worker raised: find ours
    cause = e
    while cause is not None and not isinstance(cause, errors.UserError):
      cause = cause.__cause__ or cause.__context__
    if cause is not None:
      raise cause from None
    strict = [line for line in str(e).splitlines() if "(strict_data=true)" in line]
    if strict:
      raise errors.ConfigError(strict[-1].split("ConfigError: ")[-1]) from None
    raise
  for counter in result.metrics().query(MetricsFilter().with_namespace(_NAMESPACE))["counters"]:
    bad.counts[counter.key.metric.name] += counter.committed
  return sum(s["tokens"] for split in shards for s in token_shards.shard_stats(partial, split))
