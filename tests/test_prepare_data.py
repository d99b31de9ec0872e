"""prepare_data's shards, dataset_type=grain reading them, and bad data on both sides."""

import glob
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from absl import flags
from array_record.python import array_record_module
from conftest import ROOT, run_cli, run_command, tiny_config
from tokenizers import Tokenizer

from MaxText import train
from MaxText.errors import ConfigError
from MaxText.input_pipeline import corpus, input_pipeline, prepare_data, token_shards, tokenizer

TRAIN_SHARDS = 3


def write_corpus(directory):
  """25 .jsonl documents and one .txt, of random words and lengths."""
  rng = np.random.default_rng(0)
  words = ["thou", "art", "more", "lovely", "and", "temperate", "ça", "東京", "\n"]
  text = lambda: " ".join(rng.choice(words, rng.integers(1, 60)))
  directory.mkdir()
  with open(directory / "a.jsonl", "w") as f:
    for _ in range(25):
      f.write(json.dumps({"text": text()}) + "\n")
  (directory / "b.txt").write_text(text())
  return directory


def prepare(tmp, source, *overrides):
  config = tiny_config(f"dataset_path={source}", "tokenizer_type=byte", f"output_path={tmp / 'shards'}",
                       f"num_train_shards={TRAIN_SHARDS}", "prepare_workers=1", *overrides)
  return config, prepare_data.prepare(config)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("prepared")
  config, manifest = prepare(tmp, write_corpus(tmp / "corpus"))
  return config, manifest


def records(path):
  return [np.frombuffer(r, "<i4") for r in array_record_module.ArrayRecordReader(str(path)).read_all()]


def test_shards_hold_the_text_paths_documents_round_robin_with_its_held_out_rule(prepared):
  config, manifest = prepared
  train, held_out = corpus.split_documents(corpus.read_documents(config))
  byte = tokenizer.byte_tokenizer()
  out = config.output_path
  for split, documents, count in (("train", train, TRAIN_SHARDS), ("eval", held_out, 1)):
    want = [byte.encode(d, add_special_tokens=False).ids for d in documents]
    for shard in range(count):
      got = records(os.path.join(out, token_shards.shard_name(split, shard, count)))
      assert [list(r) for r in got] == want[shard::count]
    assert manifest["splits"][split]["documents"] == len(documents)
    assert manifest["splits"][split]["tokens"] == sum(map(len, want))
  assert len(held_out) == 2 and manifest["tokenizer_fingerprint"] == tokenizer.fingerprint([byte.to_str()])
  assert manifest["bad_records"] == {} and not any(n.startswith(".partial") for n in os.listdir(out))


def grain_config(prepared, *overrides):
  out = prepared[0].output_path
  return tiny_config("dataset_type=grain", f"grain_train_files={out}/train-*", f"grain_eval_files={out}/eval-*",
                     "vocab_size=320", "grain_worker_count=0", *overrides)


def test_the_stream_is_the_shards_documents_each_closed_by_an_eod(prepared):
  config = prepared[0]
  stream, tok = token_shards.open_split("grain_train_files", f"{config.output_path}/train-*")
  eod = tokenizer.eod_id(tok, "tokenizer")
  want = np.concatenate([np.append(r, eod) for shard in range(TRAIN_SHARDS) for r in records(
      os.path.join(config.output_path, token_shards.shard_name("train", shard, TRAIN_SHARDS)))])
  assert len(stream) == len(want)
  rng = np.random.default_rng(0)
  for start in [0, len(want) - 5, *rng.integers(0, len(want), 30)]:
    stop = start + int(rng.integers(1, 400))
    np.testing.assert_array_equal(stream[start:stop], want[start:stop])


@pytest.mark.parametrize("workers", [0, 1])
def test_grain_batches_are_packed_rows_of_the_stream_and_resume_exactly(prepared, workers):
  flags.FLAGS.mark_as_parsed()  # grain's workers read its absl flags, which app.run parses outside pytest
  config = grain_config(prepared, f"grain_worker_count={workers}")
  data = input_pipeline.load(config)
  stream, _ = token_shards.open_split("grain_train_files", config.grain_train_files)
  reference = input_pipeline.text_rows(np.asarray(stream[:]), config.max_target_length, stream.eod)
  rows = reference.shuffle(seed=config.data_shuffle_seed).repeat()
  shared = set(glob.glob("/dev/shm/psm_*"))
  iterator = input_pipeline.create_train_iterator(config, data)
  batches = [next(iterator) for _ in range(2)]
  for worker in multiprocessing.active_children():  # as a scheduler signals every process: the trainer's to handle
    os.kill(worker.pid, signal.SIGTERM)
  batches += [next(iterator) for _ in range(2)]
  # A worker's batches cross pickled: grain's shared memory, freed by a thread the interpreter's
  # exit cuts short, ended every run with a "leaked shared_memory objects" warning.
  assert set(glob.glob("/dev/shm/psm_*")) <= shared
  for step, batch in enumerate(batches):
    size = config.global_batch_size_to_train_on
    for key in batch:
      np.testing.assert_array_equal(batch[key], np.stack([rows[step * size + i][key] for i in range(size)]))
  restored = input_pipeline.create_train_iterator(config, data)
  iterator = input_pipeline.create_train_iterator(config, data)
  next(iterator)
  next(iterator)
  restored.set_state(iterator.get_state())
  from_step = input_pipeline.create_train_iterator(config, data, 2)  # as a resume on any number of hosts
  for expected in batches[2:]:
    jax.tree.map(np.testing.assert_array_equal, next(restored), expected)
    jax.tree.map(np.testing.assert_array_equal, next(from_step), expected)


def test_a_missing_or_damaged_shard_is_a_config_error_naming_it(prepared, tmp_path):
  copy = tmp_path / "copy"
  shutil.copytree(prepared[0].output_path, copy)
  config = lambda: grain_config(prepared, f"grain_train_files={copy}/train-*", f"grain_eval_files={copy}/eval-*")
  original = (copy / "tokenizer.json").read_text()
  swapped = tokenizer.byte_tokenizer()
  swapped.add_special_tokens(["<|other|>"])
  swapped.save(str(copy / "tokenizer.json"))
  with pytest.raises(ConfigError, match=re.escape(f"{copy / 'tokenizer.json'} is not the tokenizer the shards were "
                                                  "tokenized with")):
    input_pipeline.load(config())
  (copy / "tokenizer.json").write_text(original)
  shard = copy / token_shards.shard_name("train", 1, TRAIN_SHARDS)
  data = shard.read_bytes()
  shard.write_bytes(data[:len(data) // 2])
  with pytest.raises(ConfigError, match=f"grain shard {shard}: unreadable"):
    input_pipeline.load(config())
  shard.unlink()
  with pytest.raises(ConfigError, match=f"grain shard {shard}: missing"):
    input_pipeline.load(config())
  (copy / "manifest.json").unlink()
  with pytest.raises(ConfigError, match="manifest.json"):
    input_pipeline.load(config())
  with pytest.raises(ConfigError, match="grain_eval_files=''"):
    input_pipeline.load(grain_config(prepared, "grain_eval_files=", "eval_interval=5"))


def test_bad_records_are_counted_and_skipped_or_stop_a_strict_run(tmp_path, capfd):
  import pyarrow
  import pyarrow.parquet
  source = tmp_path / "corpus"
  source.mkdir()
  (source / "a.jsonl").write_bytes(b'{"text": "good one"}\n{"text": \n{"body": "no text"}\n'
                                   b'{"text": "\xff\xfe"}\n{"text": ""}\n{"text": "good two"}\n')
  (source / "b.txt").write_bytes(b"\xff not utf-8")
  (source / "c.txt").write_text("")
  pyarrow.parquet.write_table(pyarrow.table({"body": ["x"]}), source / "d.parquet")
  pyarrow.parquet.write_table(pyarrow.table({"text": ["good three", None]}), source / "e.parquet")
  (source / "f.parquet").write_bytes(b"PAR1 not parquet")
  args = (f"dataset_path={source}", "tokenizer_type=byte", "prepare_workers=1")
  run_command("input_pipeline.prepare_data", *args, f"output_path={tmp_path / 'out'}")
  out, err = capfd.readouterr()  # the file descriptors: the tokenizing worker processes' output too
  summary = out.strip().splitlines()[-1]
  assert summary.endswith("skipped 9 bad records (3 no string 'text', 2 not UTF-8, 2 empty document, "
                          "1 malformed JSON, 1 unreadable file)"), summary
  assert "2 train documents" in summary and "Traceback" not in err
  with pytest.raises(ConfigError, match="^dataset_path.*a.jsonl line 2"):
    run_command("input_pipeline.prepare_data", *args, f"output_path={tmp_path / 'strict'}", "strict_data=true")
  assert not (tmp_path / "strict").exists()
  with pytest.raises(ConfigError, match="already holds a prepared corpus"):
    run_command("input_pipeline.prepare_data", *args, f"output_path={tmp_path / 'out'}")


def test_the_split_of_a_stream_is_split_documents_for_every_corpus_size():
  for count in (1, 2, 9, 10, 11, 25):
    documents = [f"document {i}\nsecond line\n" for i in range(count)]
    got = {"train": {}, "eval": {}}
    for split, position, document in corpus.split_stream(iter(documents)):
      got[split][position] = document
    train, held_out = corpus.split_documents(documents)
    assert [got["train"][k] for k in range(len(got["train"]))] == train
    assert [got["eval"][k] for k in range(len(got["eval"]))] == held_out


def test_the_beam_pipeline_writes_the_local_paths_shards(prepared, tmp_path):
  config, manifest = prepared
  result = run_cli("prepare_data", f"dataset_path={config.dataset_path}", "tokenizer_type=byte",
                   f"output_path={tmp_path}/beam", f"num_train_shards={TRAIN_SHARDS}", "runner=DirectRunner",
                   env={"PYTHONPATH": str(ROOT / ".venv" / "beam")})  # where setup.sh installs Beam, apart
  assert result.returncode == 0, result.stderr
  with open(tmp_path / "beam" / "manifest.json") as f:
    assert json.load(f)["splits"] == manifest["splits"]
  for split in manifest["splits"].values():
    for shard in split["shards"]:
      local, beam = records(os.path.join(config.output_path, shard["file"])), records(tmp_path / "beam" / shard["file"])
      assert len(local) == len(beam) == shard["documents"]
      for a, b in zip(local, beam):
        np.testing.assert_array_equal(a, b)


def parquet_files(directory) -> list[list[str]]:
  """Three parquet files of 40 short documents in `directory`; returns their texts."""
  import pyarrow
  import pyarrow.parquet
  rng = np.random.default_rng(0)
  texts = [[" ".join(["word"] * int(rng.integers(1, 12))) + f" {f}.{i}" for i in range(40)] for f in range(3)]
  for f, column in enumerate(texts):
    pyarrow.parquet.write_table(pyarrow.table({"text": column}), directory / f"{f}.parquet")
  return texts


def parquet_config(directory, *overrides):
  return tiny_config("dataset_type=grain", "grain_file_type=parquet", f"grain_train_files={directory}/*.parquet",
                     "tokenizer_type=byte", "vocab_size=320", "grain_worker_count=0", *overrides)


def test_parquet_text_streams_as_packed_rows_of_its_documents_and_resumes_exactly(tmp_path):
  texts = parquet_files(tmp_path)
  config = parquet_config(tmp_path)
  data = input_pipeline.load(config)
  iterator = input_pipeline.create_train_iterator(config, data)
  batches = [next(iterator) for _ in range(6)]
  byte = tokenizer.byte_tokenizer()
  documents = {tuple(byte.encode(t, add_special_tokens=False).ids) for column in texts for t in column}
  for batch in batches:
    for row in range(len(batch["inputs"])):
      inputs, segments = batch["inputs"][row], batch["inputs_segmentation"][row]
      # Every whole document inside a row (neither the first nor the last segment) is one of the files'.
      for segment in np.unique(segments)[1:-1]:
        ids = inputs[segments == segment]
        assert ids[-1] == 256 and tuple(ids[:-1]) in documents
      np.testing.assert_array_equal(batch["targets"][row][:-1], inputs[1:])
      assert np.all(batch["targets_segmentation"][row][inputs == 256] == 0)
  iterator = input_pipeline.create_train_iterator(config, data)
  for _ in range(3):
    next(iterator)
  state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint holds it
  restored = input_pipeline.create_train_iterator(config, data)
  restored.set_state(state)
  # A checkpoint saved before the streams were named holds each process's stream as its state.
  from_before = input_pipeline.create_train_iterator(config, data)
  from_before.restore({0: state["streams"]["0"]}, 1)
  for expected in batches[3:]:
    jax.tree.map(np.testing.assert_array_equal, next(restored), expected)
    jax.tree.map(np.testing.assert_array_equal, next(from_before), expected)


def test_a_grain_run_trains_and_keeps_the_shards_tokenizer_for_decode(prepared, tmp_path):
  config = grain_config(prepared, f"base_output_directory={tmp_path}", "steps=2", "run_name=grain", "eval_interval=2",
                        "eval_steps=1", "enable_checkpointing=true", f"metrics_file={tmp_path}/metrics.jsonl")
  train.train(config)
  kept = Tokenizer.from_file(str(tmp_path / "grain" / "tokenizer.json"))
  shards = Tokenizer.from_file(os.path.join(prepared[0].output_path, "tokenizer.json"))
  assert kept.to_str() == shards.to_str()
  assert [p.name for p in (tmp_path / "grain" / "checkpoints").iterdir()] == ["2"]
  last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
  assert np.isfinite(last["eval/loss"])


def test_parquet_streams_make_each_global_batch_whatever_the_processes_and_resume_on_fewer(tmp_path, monkeypatch):
  """Two processes reading one of 2 streams each hold the halves of the one process's global
  batches; the positions both saved resume on one process to the batches it draws on."""
  parquet_files(tmp_path)
  config = parquet_config(tmp_path, "grain_stream_count=2")
  data = input_pipeline.load(config)
  whole = input_pipeline.create_train_iterator(config, data)
  expected = [next(whole) for _ in range(5)]
  half = config.global_batch_size_to_train_on // 2
  saved = {}
  for process in (0, 1):
    monkeypatch.setattr(jax, "process_index", lambda p=process: p)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    part = input_pipeline.create_train_iterator(config, data)
    mine = slice(process * half, (process + 1) * half)
    for batch in expected[:3]:
      jax.tree.map(lambda a, b, mine=mine: np.testing.assert_array_equal(a, b[mine]), next(part), batch)
    saved[process] = json.loads(json.dumps(part.get_state()))  # as process_<process>-of-2.json holds it
  monkeypatch.undo()
  resumed = input_pipeline.create_train_iterator(config, data)
  resumed.restore(saved, 2)
  for batch in expected[3:]:
    jax.tree.map(np.testing.assert_array_equal, next(resumed), batch)
  with pytest.raises(ConfigError, match=r"grain_stream_count=2: the run's data position was saved as 3 streams"):
    resumed.set_state({**saved[0], "stream_count": 3})


@pytest.mark.parametrize("overrides, message", [
    (["grain_stream_count=3"], "grain_stream_count=3: the parquet files are read as 3 streams, each giving its part "
                               "of the global batch of … rows"),
    (["grain_stream_count=4"], "grain_train_files='…/*.parquet': 3 parquet files, fewer than the 4 streams they are "
                               "read as (grain_stream_count; 0: one per process)")])
def test_parquet_streams_that_cannot_make_the_batch_are_one_line_writing_nothing(tmp_path, overrides, message):
  parquet_files(tmp_path)
  before = sorted(tmp_path.iterdir())
  with pytest.raises(ConfigError, match=".*".join(map(re.escape, message.split("…")))) as raised:
    train.train(parquet_config(tmp_path, f"base_output_directory={tmp_path}", "run_name=p", *overrides))
  assert "\n" not in str(raised.value) and sorted(tmp_path.iterdir()) == before


def test_a_parquet_run_resumed_with_another_stream_count_is_one_line_and_keeps_its_checkpoint(tmp_path):
  parquet_files(tmp_path)
  run = lambda *o: train.train(parquet_config(tmp_path, f"base_output_directory={tmp_path}", "run_name=p",
                                              "enable_checkpointing=true", "async_checkpointing=false", *o))
  run("steps=2")
  before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "p").rglob("*"))
  with pytest.raises(ConfigError, match="grain_stream_count=2: run .* reads its parquet files as 1 streams"):
    run("steps=4", "grain_stream_count=2")
  assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "p").rglob("*")) == before


def test_one_writer_at_a_time_and_a_prepared_corpus_is_replaced_only_when_asked(prepared, tmp_path):
  config = prepared[0]
  out = tmp_path / "shards"
  shutil.copytree(config.output_path, out)
  (out / "notes.txt").write_text("mine")
  before = sorted(p.name for p in out.iterdir())
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "MaxText"])  # a live writer
  try:
    (out / ".lock").write_text(str(holder.pid))
    with pytest.raises(ConfigError, match=re.escape(f"output_path: {out} is being prepared by process {holder.pid}")):
      prepare(tmp_path, config.dataset_path, "overwrite_output_path=true")
  finally:
    holder.kill()
  (out / ".lock").unlink()
  with pytest.raises(ConfigError, match="already holds a prepared corpus .* set overwrite_output_path=true"):
    prepare(tmp_path, config.dataset_path, "num_train_shards=2")
  assert sorted(p.name for p in out.iterdir()) == before
  _, manifest = prepare(tmp_path, config.dataset_path, "num_train_shards=2", "overwrite_output_path=true")
  assert [s["file"] for s in manifest["splits"]["train"]["shards"]] == [token_shards.shard_name("train", i, 2)
                                                                          for i in range(2)]
  assert sorted(p.name for p in out.glob("train-*")) == sorted(
      n for i in range(2) for n in (token_shards.shard_name("train", i, 2), f"train-{i:05d}-of-00002.offsets"))
  assert (out / "notes.txt").read_text() == "mine" and not (out / ".lock").exists()


@pytest.mark.parametrize("manifest, message", [
    ({"tokenizer": "../victim.txt", "splits": {}}, "lists '../victim.txt', not a file name in output_path"),
    ("garbage", "does not say which files the corpus is"),
    ({"splits": {"train": {"shards": []}}}, "does not say which files the corpus is .KeyError: 'tokenizer'"),
])
def test_a_manifest_that_names_other_files_or_none_is_refused_before_any_work(prepared, tmp_path, manifest, message):
  """overwrite_output_path=true removes only plain file names the manifest lists, and reads the
  manifest before tokenizing anything: a manifest pointing outside output_path, or one that is not
  a manifest, is one line, with every file where it was and no staging directory left."""
  out = tmp_path / "shards"
  shutil.copytree(prepared[0].output_path, out)
  (tmp_path / "victim.txt").write_text("mine")
  (out / token_shards.MANIFEST).write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
  before = sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
  with pytest.raises(ConfigError, match=f"output_path=.*{message}"):
    prepare(tmp_path, prepared[0].dataset_path, "overwrite_output_path=true")
  assert sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == before
  assert not list(out.glob(".prepare_data-*"))


def test_a_users_file_of_a_shards_name_is_replaced_only_when_asked(prepared, tmp_path):
  out = tmp_path / "shards"
  out.mkdir()
  mine = out / token_shards.shard_name("train", 0, TRAIN_SHARDS)
  mine.write_text("mine")
  with pytest.raises(ConfigError, match=f"holds {mine.name}, which this preparation writes, and no manifest.json"):
    prepare(tmp_path, prepared[0].dataset_path)
  assert mine.read_text() == "mine" and sorted(p.name for p in out.iterdir()) == [mine.name]
  _, manifest = prepare(tmp_path, prepared[0].dataset_path, "overwrite_output_path=true")
  assert manifest["splits"] == prepared[1]["splits"]
  assert mine.read_bytes() == (Path(prepared[0].output_path) / mine.name).read_bytes()


def test_a_killed_writers_leftovers_are_removed_and_paths_in_the_way_are_one_line(prepared, tmp_path):
  config = prepared[0]
  dead = subprocess.Popen(["true"])
  dead.wait()
  leftover = tmp_path / "shards" / f".prepare_data-{dead.pid}.partial"  # what a SIGKILL leaves
  leftover.mkdir(parents=True)
  (leftover / "train-00000-of-00003.spill").write_bytes(b"\0" * 8)
  prepare(tmp_path, config.dataset_path)
  assert not leftover.exists() and (tmp_path / "shards" / "manifest.json").exists()
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ConfigError, match=re.escape(f"output_path: cannot write '{tmp_path / 'a_file'}'")):
    prepare_data.prepare(tiny_config(f"dataset_path={config.dataset_path}", "tokenizer_type=byte",
                                     f"output_path={tmp_path / 'a_file'}"))


def test_sigterm_stops_prepare_data_with_one_line_and_leaves_nothing(prepared, tmp_path):
  out = tmp_path / "out"
  process = subprocess.Popen([sys.executable, "-m", "MaxText.prepare_data", str(ROOT / "configs" / "base.yml"),
                              f"dataset_path={prepared[0].dataset_path}", "tokenizer_type=byte", f"output_path={out}",
                              "prepare_workers=1"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
  deadline = time.time() + 120
  while time.time() < deadline and process.poll() is None and not list(out.glob(".prepare_data-*.partial")):
    time.sleep(0.01)
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == "stopped: SIGTERM before the output was complete: nothing was written"
  assert not out.exists()
