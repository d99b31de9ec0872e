"""Weighted mixtures of prepared corpora and of parquet globs: which rows, resumed, their metrics, bad input."""

import json
import logging
import math
import re
from fractions import Fraction

import jax
import numpy as np
import pytest
from absl import flags
from conftest import TINY, run_command, tiny_config

from MaxText import run_control, sharding, train, train_step
from MaxText.errors import ConfigError
from MaxText.input_pipeline import input_pipeline, mixture, prepare_data, token_shards, tokenizer

# name -> (its documents' letters, train documents): no two corpora share a letter, so a row's
# tokens say which corpus it came from; sizes differ, so the sources' epochs do.
CORPORA = {"alpha": ("ab", 40), "beta": ("cd", 20), "gamma": ("ef", 12)}
WEIGHTS = ("0.5", "0.3", "0.2")


def write_documents(directory, letters, count, longest, seed):
  directory.mkdir(parents=True)
  rng = np.random.default_rng(seed)
  with open(directory / "documents.jsonl", "w") as f:
    for _ in range(count):
      f.write(json.dumps({"text": "".join(rng.choice(list(letters), rng.integers(1, longest)))}) + "\n")
  return directory


def prepare(tmp, name, letters, count, *overrides, longest=60):
  source = write_documents(tmp / "text" / name, letters, count, longest, seed=count)
  prepare_data.prepare(tiny_config(f"dataset_path={source}", "tokenizer_type=byte", f"output_path={tmp / name}",
                                   "num_train_shards=2", "prepare_workers=1", *overrides))
  return tmp / name


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("corpora")
  return {name: prepare(tmp, name, letters, count) for name, (letters, count) in CORPORA.items()}


def mixture_of(corpora, files, weights=WEIGHTS):
  return ";".join(f"{corpora[name]}/{files},{weight}" for name, weight in zip(CORPORA, weights))


def grain_config(corpora, *overrides):
  return tiny_config("dataset_type=grain", f"grain_train_files={mixture_of(corpora, 'train-*')}", "vocab_size=320",
                     "grain_worker_count=0", *overrides)


def reference_sources(weights, rows):
  """Which source each of the first `rows` rows comes from, drawn one row at a time: source i
  takes a row that sources 0..i-1 left whenever its count of such rows falls behind
  ceil(seen * w_i / (w_i + ... + w_last))."""
  weights = [Fraction(w) for w in weights]
  seen, taken, drawn = [0] * len(weights), [0] * len(weights), []
  for _ in range(rows):
    for i, weight in enumerate(weights):
      seen[i] += 1
      if taken[i] < math.ceil(seen[i] * weight / sum(weights[i:])):
        taken[i] += 1
        drawn.append(i)
        break
  return drawn


def reference_rows(config, corpora, rows):
  """The first `rows` rows of the mixture, by a plain loop: the k-th row of source s is row k mod
  its size of epoch k // size, shuffled with the source's seed plus that epoch."""
  streams = [token_shards.open_split("grain_train_files", f"{corpora[name]}/train-*")[0] for name in CORPORA]
  sources = [input_pipeline.text_rows(np.asarray(s[:]), config.max_target_length, s.eod) for s in streams]
  drawn, out = [0] * len(sources), []
  for s in reference_sources(WEIGHTS, rows):
    epoch, k = divmod(drawn[s], len(sources[s]))
    seed = (config.data_shuffle_seed + s * mixture.SEED_STRIDE + epoch) % 2**32
    out.append(sources[s].shuffle(seed=seed)[k])
    drawn[s] += 1
  return out, drawn, [len(s) for s in sources]


def corpus_of(row) -> str:
  byte = tokenizer.byte_tokenizer()
  tokens = set(row["inputs"].tolist()) - {tokenizer.eod_id(byte, "byte")}
  return next(name for name, (letters, _) in CORPORA.items() if tokens <= set(byte.encode(letters).ids))


@pytest.mark.parametrize("weights", [(1, 1), (3, 1, 1), (0.5, 0.3, 0.2), (1, 1000), (Fraction(1, 3), 2, 7, 0.25)])
def test_every_prefix_holds_each_source_within_a_few_rows_of_its_share(weights):
  interleave = mixture.Interleave([Fraction(w) for w in weights])
  shares = [Fraction(w) / sum(map(Fraction, weights)) for w in weights]
  drawn = reference_sources(weights, 2000)
  for rows in range(0, 2001, 37):
    counts = interleave.counts(rows)
    assert counts == [drawn[:rows].count(i) for i in range(len(weights))]
    assert all(abs(c - rows * share) < len(weights) for c, share in zip(counts, shares))
  assert [interleave[r] for r in range(300)] == [(s, drawn[:r].count(s)) for r, s in enumerate(drawn[:300])]


def test_rows_are_each_sources_reshuffled_epochs_in_the_weights_shares(corpora):
  config = grain_config(corpora)
  data = input_pipeline.load(config)
  rows = 400
  want, drawn, sizes = reference_rows(config, corpora, rows)
  assert all(d > size for d, size in zip(drawn, sizes))  # every source is into its second epoch or later
  got = [data.train[r] for r in range(rows)]
  for a, b in zip(got, want):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  from_tokens = [corpus_of(row) for row in got]
  for name, weight in zip(CORPORA, WEIGHTS):
    assert abs(from_tokens.count(name) / rows - float(weight)) < 0.02
  assert data.progress(rows) == {k: v for name, d, size in zip(CORPORA, drawn, sizes)
                                 for k, v in ((f"data/fraction/{name}", d / rows), (f"data/epochs/{name}", d / size))}


def test_random_access_equals_sequential_iteration(corpora):
  data = input_pipeline.load(grain_config(corpora))
  rows = 120
  sequential = [row for _, row in zip(range(rows), data.train.to_iter_dataset())]
  order = np.random.default_rng(0).permutation(rows)
  for r in order:
    jax.tree.map(np.testing.assert_array_equal, data.train[int(r)], sequential[r])


def test_batches_from_any_step_are_the_uninterrupted_ones_on_one_or_two_processes(corpora, monkeypatch):
  config = grain_config(corpora)
  data = input_pipeline.load(config)
  assert input_pipeline.resumes_by_step(data)
  iterator = input_pipeline.create_train_iterator(config, data)
  whole = [next(iterator) for _ in range(6)]
  size = config.global_batch_size_to_train_on
  for step, batch in enumerate(whole):
    jax.tree.map(np.testing.assert_array_equal, batch,
                 jax.tree.map(lambda *rows: np.stack(rows), *[data.train[step * size + i] for i in range(size)]))
  flags.FLAGS.mark_as_parsed()  # grain's workers read its absl flags, which app.run parses outside pytest
  in_a_worker = grain_config(corpora, "grain_worker_count=1")  # the mixture pickled into a worker process
  resumed = input_pipeline.create_train_iterator(in_a_worker, input_pipeline.load(in_a_worker), 4)
  for want in whole[4:]:
    jax.tree.map(np.testing.assert_array_equal, next(resumed), want)
  for processes in (1, 2):
    monkeypatch.setattr(jax, "process_count", lambda processes=processes: processes)
    parts = []
    for p in range(processes):
      monkeypatch.setattr(jax, "process_index", lambda p=p: p)
      resumed = input_pipeline.create_train_iterator(config, data, 4)
      parts.append([next(resumed) for _ in range(2)])
    for step in range(2):
      jax.tree.map(lambda want, *got: np.testing.assert_array_equal(np.concatenate(got), want), whole[4 + step],
                   *[part[step] for part in parts])


def test_a_lone_glob_with_or_without_a_weight_reads_as_before(corpora):
  lone = f"{corpora['alpha']}/train-*"
  config = grain_config(corpora, f"grain_train_files={lone}")
  stream, _ = token_shards.open_split("grain_train_files", lone)
  before = input_pipeline.text_rows(np.asarray(stream[:]), config.max_target_length, stream.eod)
  before = before.shuffle(seed=config.data_shuffle_seed).repeat()
  for value in (lone, f"{lone},3"):
    data = input_pipeline.load(grain_config(corpora, f"grain_train_files={value}"))
    for r in range(3 * len(stream) // config.max_target_length):
      jax.tree.map(np.testing.assert_array_equal, data.train[r], before[r])


def test_a_lone_glob_with_a_comma_in_its_path_is_a_path():
  """Nothing numeric after a lone glob's last comma: the comma is the path's; a number is a weight."""
  assert mixture.parse("k", "d/a,b/train-*") == [mixture.Source("d/a,b/train-*", Fraction(1))]
  assert mixture.parse("k", "d/a,b/train-*,3") == [mixture.Source("d/a,b/train-*", Fraction(3))]
  with pytest.raises(ConfigError, match="source 'd/x-\\*' has weight '-2', not a positive number"):
    mixture.parse("k", "d/x-*,-2")


def test_each_eval_source_scores_as_it_does_alone_and_eval_loss_is_their_weighted_mean(corpora):
  weights = (1, 3)
  names = list(CORPORA)[:2]
  mixed = grain_config(corpora, "eval_steps=2", "grain_eval_files=" + ";".join(
      f"{corpora[name]}/eval-*,{w}" for name, w in zip(names, weights)))
  trainer = train_step.build(mixed, sharding.create_mesh(mixed))
  with sharding.activate(trainer.mesh, mixed):
    params = trainer.init(jax.random.key(0)).params
    got = train.evaluate(trainer, mixed, params, input_pipeline.load(mixed))
    alone = {}
    for name in names:
      config = grain_config(corpora, "eval_steps=2", f"grain_eval_files={corpora[name]}/eval-*")
      alone[name] = train.evaluate(trainer, config, params, input_pipeline.load(config))
  for name in names:
    for metric in ("loss", "perplexity", "accuracy"):
      assert got[f"eval/{name}/{metric}"] == alone[name][f"eval/{metric}"]
  assert alone[names[0]]["eval/loss"] != alone[names[1]]["eval/loss"]
  for metric in ("loss", "accuracy"):
    mean = sum(w * alone[n][f"eval/{metric}"] for n, w in zip(names, weights)) / sum(weights)
    assert got[f"eval/{metric}"] == pytest.approx(mean, rel=1e-12)
  assert got["eval/perplexity"] == pytest.approx(math.exp(got["eval/loss"]), rel=1e-12)


def test_sources_are_named_by_their_corpus_directory_numbered_when_two_share_one():
  directories = ["/d/web", "/e/web", "/d/books"]
  unnamed = [mixture.Source(d, Fraction(1)) for d in directories]
  assert mixture.names(unnamed, directories) == ["web_1", "web_2", "books"]
  # A numbered name never takes another source's: each keeps its own data/fraction metric.
  directories = ["/d/web", "/e/web", "/f/web_1"]
  assert mixture.names([mixture.Source(d, Fraction(1)) for d in directories], directories) == ["web_2", "web_3",
                                                                                                "web_1"]


def test_a_mixture_file_names_its_sources_and_draws_the_rows_of_the_same_mixture_inline(corpora, tmp_path):
  """grain_train_files=FILE.yml: the sources in the file's order, its names for their metrics, and
  the rows, shares and epochs of the same globs and weights given inline."""
  names = ("web", "code", "math")
  spec = {name: {"files": f"{corpora[corpus]}/train-*", "weight": weight}
          for name, corpus, weight in zip(names, CORPORA, WEIGHTS)}
  (tmp_path / "mixture.yml").write_text(json.dumps(spec))  # JSON is YAML
  inline = input_pipeline.load(grain_config(corpora))
  from_file = input_pipeline.load(grain_config(corpora, f"grain_train_files={tmp_path / 'mixture.yml'}"))
  for r in range(60):
    jax.tree.map(np.testing.assert_array_equal, from_file.train[r], inline.train[r])
  renamed = dict(zip(CORPORA, names))
  assert from_file.progress(60) == {re.sub(r"/(\w+)$", lambda m: "/" + renamed[m[1]], k): v
                                    for k, v in inline.progress(60).items()}


@pytest.mark.parametrize("content, message", [
    (None, "cannot read the mixture file"),
    ("[a, b]", "a mixture file maps each source's name to its files and weight"),
    ("web: {files: 'x/*'}", "source 'web' must have exactly files (a glob) and weight"),
    ("web: {files: 'x/*', weight: -2}", "source 'web' has weight -2, not a positive number"),
    ("web: [unclosed", "not YAML"),
    ("web: {files: 'x/*', weight: 1}\nweb: {files: 'y/*', weight: 2}", "source 'web' is named twice"),
])
def test_a_bad_mixture_file_is_one_line_naming_it(tmp_path, content, message):
  path = tmp_path / "mixture.yml"
  if content is not None:
    path.write_text(content)
  with pytest.raises(ConfigError, match=re.escape(f"grain_train_files={str(path)!r}: ") + ".*" + re.escape(message)):
    tiny_config("dataset_type=grain", f"grain_train_files={path}")


@pytest.fixture(scope="module")
def bad_corpora(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("bad")
  other = tokenizer.byte_tokenizer()
  other.add_special_tokens(["<|other|>"])
  other.save(str(tmp / "other.json"))
  return {"other": prepare(tmp, "other", "ab", 20, f"tokenizer_path={tmp / 'other.json'}"),
          "small": prepare(tmp, "small", "cd", 3, longest=3)}


# What each bad value of grain_train_files is, and the line it gives ("…": anything).
BAD = {
    "negative weight": (lambda c: f"{c['alpha']}/train-*,-1;{c['beta']}/train-*,1",
                        lambda c: f"source '{c['alpha']}/train-*' has weight '-1', not a positive number"),
    "zero weight": (lambda c: f"{c['alpha']}/train-*,1;{c['beta']}/train-*,0",
                    lambda c: f"source '{c['beta']}/train-*' has weight '0', not a positive number"),
    "weight not a number": (lambda c: f"{c['alpha']}/train-*,half;{c['beta']}/train-*,1",
                            lambda c: f"source '{c['alpha']}/train-*' has weight 'half'"),
    "weights on some sources": (lambda c: f"{c['alpha']}/train-*,1;{c['beta']}/train-*",
                                lambda c: f"source '{c['beta']}/train-*' has no weight"),
    "a glob matching nothing": (lambda c: f"{c['alpha']}/train-*,1;{c['alpha']}/nothing-*,1",
                                lambda c: f"grain_train_files='{c['alpha']}/nothing-*': matches no .arrayrecord"),
    "another tokenizer": (lambda c: f"{c['alpha']}/train-*,1;{c['other']}/train-*,1",
                          lambda c: f"source 'other' ({c['other']}/train-*) was tokenized with another tokenizer "
                                    "(vocabulary 258) than source 'alpha' (vocabulary 257)"),
    "fewer tokens than a row": (lambda c: f"{c['alpha']}/train-*,1;{c['small']}/train-*,1",
                                lambda c: f"grain_train_files='{c['small']}/train-*': … tokens, fewer than one row"),
}


def assert_refused_with_one_line_writing_nothing(value, message, tmp_path, *overrides):
  with pytest.raises(ConfigError, match=".*".join(map(re.escape, message.split("…")))) as raised:
    run_command("train", *TINY, "dataset_type=grain", f"grain_train_files={value}", "vocab_size=320",
                f"base_output_directory={tmp_path}", "run_name=bad", *overrides)
  assert "\n" not in str(raised.value)
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_mixture_is_one_line_naming_its_source_and_writes_nothing(corpora, bad_corpora, tmp_path, bad):
  paths = {**corpora, **bad_corpora}
  assert_refused_with_one_line_writing_nothing(*(f(paths) for f in BAD[bad]), tmp_path)


def write_parquet(directory, letters, count, seed, files=2):
  """`count` documents of `letters` (as write_documents), split over `files` parquet files."""
  import pyarrow
  import pyarrow.parquet
  directory.mkdir(parents=True)
  rng = np.random.default_rng(seed)
  texts = ["".join(rng.choice(list(letters), rng.integers(1, 60))) for _ in range(count)]
  for f in range(files):
    pyarrow.parquet.write_table(pyarrow.table({"text": texts[f::files]}), directory / f"{f}.parquet")
  return directory


def texts_of(directory):
  import pyarrow.parquet
  return [t for path in sorted(directory.glob("*.parquet"))
          for t in pyarrow.parquet.read_table(path)["text"].to_pylist()]


@pytest.fixture(scope="module")
def parquets(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("parquet")
  return {name: write_parquet(tmp / name, letters, count, seed=count) for name, (letters, count) in CORPORA.items()}


def parquet_config(train_files, *overrides):
  return tiny_config("dataset_type=grain", "grain_file_type=parquet", "tokenizer_type=byte", "vocab_size=320",
                     "grain_worker_count=0", f"grain_train_files={train_files}", *overrides)


def test_parquet_sources_stream_in_the_weights_shares_each_as_it_streams_alone(parquets):
  config = parquet_config(mixture_of(parquets, "*.parquet"))
  data = input_pipeline.load(config)
  rows = 400
  got = [row for _, row in zip(range(rows), data.train[0])]  # its one stream
  order = [list(CORPORA)[s] for s in reference_sources(WEIGHTS, rows)]
  assert [corpus_of(row) for row in got] == order
  for name, weight in zip(CORPORA, WEIGHTS):
    assert abs(order.count(name) / rows - float(weight)) < 0.02
  for i, name in enumerate(CORPORA):  # each source's rows are its stream's, seeded as a prepared corpus is
    alone = input_pipeline.load(parquet_config(f"{parquets[name]}/*.parquet",
                                               f"data_shuffle_seed={config.data_shuffle_seed + i * 2**20}"))
    mine = [row for row, source in zip(got, order) if source == name]
    for a, b in zip(mine, alone.train[0]):
      jax.tree.map(np.testing.assert_array_equal, a, b)
    # each source ran out and was repeated at least twice (its documents and EODs over the rows' tokens)
    assert len(mine) * config.max_target_length > 2 * sum(len(d) + 1 for d in texts_of(parquets[name]))
  assert data.progress(rows) == {f"data/fraction/{name}": order.count(name) / rows for name in CORPORA}


def test_a_parquet_mixture_cut_and_restored_from_its_saved_state_draws_the_uninterrupted_rows(parquets):
  config = parquet_config(mixture_of(parquets, "*.parquet"))
  iterator = input_pipeline.create_train_iterator(config, input_pipeline.load(config))
  whole = [next(iterator) for _ in range(6)]
  cut = input_pipeline.create_train_iterator(config, input_pipeline.load(config))
  for _ in range(4):
    next(cut)
  saved = json.dumps(cut.get_state())  # as the checkpoint's `data` item holds it
  resumed = input_pipeline.create_train_iterator(config, input_pipeline.load(config))
  resumed.set_state(json.loads(saved))
  for want in whole[4:]:
    jax.tree.map(np.testing.assert_array_equal, next(resumed), want)


# What each bad parquet value of grain_train_files is, and the line it gives.
BAD_PARQUET = {
    "a glob matching nothing": (
        lambda p: f"{p['alpha']}/*.parquet,1;{p['beta']}/nothing-*.parquet,1",
        lambda p: f"grain_train_files='{p['beta']}/nothing-*.parquet': no parquet file matches"),
    "weight not a number": (lambda p: f"{p['alpha']}/*.parquet,1;{p['beta']}/*.parquet,x",
                            lambda p: f"source '{p['beta']}/*.parquet' has weight 'x', not a positive number"),
}


@pytest.mark.parametrize("bad", BAD_PARQUET)
def test_a_bad_parquet_mixture_is_one_line_naming_its_source_and_writes_nothing(parquets, tmp_path, bad):
  assert_refused_with_one_line_writing_nothing(*(f(parquets) for f in BAD_PARQUET[bad]), tmp_path,
                                               "grain_file_type=parquet", "tokenizer_type=byte")


def test_new_weights_at_a_resume_are_logged_with_the_old_ones(corpora, tmp_path, caplog):
  (tmp_path / "default").mkdir()  # made by run_lock in a run
  old, new = mixture_of(corpora, "train-*"), mixture_of(corpora, "train-*", ("0.2", "0.3", "0.5"))
  run_control.record_run_files(grain_config(corpora, f"base_output_directory={tmp_path}"), None)
  with caplog.at_level(logging.WARNING):
    run_control.record_run_files(grain_config(corpora, f"base_output_directory={tmp_path}",
                                              f"grain_train_files={new}"), None)
  assert f"trained on grain_train_files={old!r} and resumes with {new!r}, a new phase" in caplog.text


def test_the_same_mixture_from_a_file_at_a_resume_is_no_new_phase(corpora, tmp_path, caplog):
  """An inline mixture, then a mixture file naming the same globs and weights in the same order."""
  (tmp_path / "default").mkdir()
  run_control.record_run_files(grain_config(corpora, f"base_output_directory={tmp_path}"), None)
  sources = mixture.parse("grain_train_files", mixture_of(corpora, "train-*"))
  (tmp_path / "mixture.yml").write_text("".join(f"s{i}: {{files: '{s.pattern}', weight: {s.weight}}}\n"
                                                for i, s in enumerate(sources)))
  with caplog.at_level(logging.WARNING):
    run_control.record_run_files(grain_config(corpora, f"base_output_directory={tmp_path}",
                                              f"grain_train_files={tmp_path / 'mixture.yml'}"), None)
  assert "a new phase" not in caplog.text


def logged_run(make_config, tmp_path, name, steps, *overrides):
  """(config, {step: its logged metrics but timings}) of a run of `steps` steps, saving every 2."""
  config = make_config(f"base_output_directory={tmp_path}", f"run_name={name}", f"steps={steps}",
                       "enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false",
                       "learning_rate_schedule_steps=4", f"metrics_file={tmp_path / name}.jsonl", *overrides)
  train.train(config)
  records = map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())
  return config, {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/")} for r in records}


@pytest.mark.slow
def test_a_mixture_run_cut_and_resumed_logs_what_the_uninterrupted_one_does(corpora, tmp_path):
  """Losses, per-source eval and data metrics of a run stopped at step 2 and resumed to 4 are
  those of the 4-step run, and data/* are the fractions and epochs of the rows drawn so far."""
  evals = ";".join(f"{corpora[name]}/eval-*,{w}" for name, w in zip(CORPORA, WEIGHTS))
  run = lambda name, steps: logged_run(lambda *o: grain_config(corpora, *o), tmp_path, name, steps, "eval_interval=2",
                                       "eval_steps=1", f"grain_eval_files={evals}")
  config, whole = run("whole", 4)
  run("cut", 2)
  assert run("cut", 4)[1] == whole
  _, drawn, sizes = reference_rows(config, corpora, 4 * config.global_batch_size_to_train_on)
  for name, d, size in zip(CORPORA, drawn, sizes):
    assert whole[4][f"data/fraction/{name}"] == d / sum(drawn) and whole[4][f"data/epochs/{name}"] == d / size
    assert np.isfinite(whole[4][f"eval/{name}/loss"])


def test_a_parquet_mixture_run_cut_and_resumed_logs_what_the_uninterrupted_one_does(parquets, tmp_path):
  """Its checkpoint's `data` item holds every stream's position of every source: the run resumed
  from the files two processes would have saved, a stream each, draws the uninterrupted run's
  batches (its losses and data/fraction)."""
  run = lambda name, steps: logged_run(lambda *o: parquet_config(mixture_of(parquets, "*.parquet"), *o), tmp_path,
                                       name, steps, "grain_stream_count=2")
  _, whole = run("whole", 4)
  run("cut", 2)
  data = tmp_path / "cut" / "checkpoints" / "2" / "data"
  saved = json.loads((data / "process_0-of-1.json").read_text())
  for k in (0, 1):
    (data / f"process_{k}-of-2.json").write_text(json.dumps({**saved, "streams": {str(k): saved["streams"][str(k)]}}))
  (data / "process_0-of-1.json").unlink()
  assert run("cut", 4)[1] == whole
