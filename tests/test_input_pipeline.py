"""Corpus, tokenizers, packing and the grain pipeline."""

import json
import re

import jax
import numpy as np
import pytest
from conftest import TINY_TEXT, tiny_config
from tokenizers import Tokenizer, models

from MaxText.errors import ConfigError
from MaxText.input_pipeline import corpus, input_pipeline, tokenizer


def text_config(tmp_path, *overrides):
  """A fresh cache under tmp_path, for tests about what gets cached."""
  return tiny_config(*TINY_TEXT, f"dataset_cache_dir={tmp_path / 'cache'}", *overrides)


@pytest.fixture
def shared(text_cache):
  """Configs on the session's cache, for tests that only read the data."""
  return lambda *overrides: tiny_config(*TINY_TEXT, text_cache, *overrides)


def load(config):
  """input_pipeline.load, its caches then written as train writes them: the corpus is tokenized
  once for the session's tests."""
  data = input_pipeline.load(config)
  data.save_caches()
  return data


def test_strip_markdown_keeps_the_words_and_drops_the_markup():
  md = ("# Macbeth\n\n## ACT I\n\n### SCENE I. A desert place.\n\n_Thunder and lightning._\n\n"
        "**First Witch**  \nWhen shall we three meet again  \nIn thunder?\n\n__\\[Aside]_  \n"
        "You,'\\--or 'I would request you,'\\--or\n\n\n\n*Exeunt*\n")
  assert corpus.strip_markdown(md) == (
      "Macbeth\n\nACT I\n\nSCENE I. A desert place.\n\nThunder and lightning.\n\nFirst Witch\n"
      "When shall we three meet again\nIn thunder?\n\n[Aside]\nYou,'--or 'I would request you,'--or\n\n"
      "Exeunt\n")


def test_default_corpus_is_shakespeare_with_whole_plays_held_out(shared):
  documents = corpus.read_documents(shared())
  assert len(documents) == 38
  assert not any(c in "".join(documents) for c in "*_#\\")
  train, held_out = corpus.split_documents(documents)
  assert len(held_out) == 3 and len(train) == 35
  assert [d.splitlines()[0] for d in held_out] == [
      documents[i].splitlines()[0] for i in (9, 19, 29)]
  assert set(train).isdisjoint(held_out)


def test_user_text_files_directories_globs_and_jsonl(tmp_path):
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "a.txt").write_text("alpha text")
  (tmp_path / "d" / "b.txt").write_text("beta text")
  (tmp_path / "c.jsonl").write_text(json.dumps({"body": "gamma"}) + "\n\n" + json.dumps({"body": "delta"}) + "\n")
  read = lambda path, *o: corpus.read_documents(text_config(tmp_path, f"dataset_path={path}", *o))
  assert read(tmp_path / "d") == ["alpha text", "beta text"]
  assert read(tmp_path / "d" / "b.txt") == ["beta text"]
  assert read(f"{tmp_path}/d/*.txt") == ["alpha text", "beta text"]
  assert read(tmp_path / "c.jsonl", "text_column=body") == ["gamma", "delta"]
  with pytest.raises(ConfigError, match="text_column='text'.*c.jsonl line 1"):
    read(tmp_path / "c.jsonl")
  with pytest.raises(ConfigError, match="dataset_path=.*nowhere': no such file or directory"):
    read(tmp_path / "nowhere")
  with pytest.raises(ConfigError, match="dataset_path='/dev/zero': not a regular file"):  # not read till memory ends
    read("/dev/zero")
  (tmp_path / "empty.txt").write_text("  \n")
  with pytest.raises(ConfigError, match="empty"):
    read(tmp_path / "empty.txt")
  bom = b"\xef\xbb\xbf"  # the byte-order mark some editors put before UTF-8 text
  (tmp_path / "bom.jsonl").write_bytes(bom + json.dumps({"text": "epsilon"}).encode() + b"\n")
  (tmp_path / "bom.txt").write_bytes(bom + b"zeta")
  assert read(tmp_path / "bom.jsonl") == ["epsilon"] and read(tmp_path / "bom.txt") == ["zeta"]


def test_directories_do_not_follow_links_out_of_or_back_into_themselves(tmp_path):
  (tmp_path / "corpus" / "sub").mkdir(parents=True)
  (tmp_path / "corpus" / "sub" / "a.txt").write_text("inside")
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "b.txt").write_text("outside")
  (tmp_path / "corpus" / "loop").symlink_to(tmp_path / "corpus")
  (tmp_path / "corpus" / "sub" / "up").symlink_to(tmp_path)
  (tmp_path / "corpus" / "elsewhere").symlink_to(tmp_path / "other")
  config = text_config(tmp_path, f"dataset_path={tmp_path / 'corpus'}")
  assert corpus.read_documents(config) == ["inside"]


def test_one_document_holds_out_its_last_tenth():
  text = "".join(f"line {i}\n" for i in range(100))
  train, held_out = corpus.split_documents([text])
  assert train[0] + held_out[0] == text and held_out[0].startswith("line 90\n")


def test_bpe_is_trained_at_vocab_size_then_reused_from_the_cache(tmp_path, monkeypatch):
  config = text_config(tmp_path)
  documents = corpus.split_documents(corpus.read_documents(config))[0]
  first, cache = tokenizer.load_or_train(config, documents)
  assert first.get_vocab_size() == config.vocab_size
  tokenizer.save_atomic(first, cache)
  monkeypatch.setattr(tokenizer, "train_bpe", lambda *_: pytest.fail("trained twice"))
  assert tokenizer.load_or_train(config, documents)[0].to_str() == first.to_str()
  text = "Is this a dagger which I see before me?"
  assert first.decode(first.encode(text).ids) == text


def test_tokenizer_path_loads_any_tokenizer_json_and_bad_ones_are_config_errors(tmp_path):
  path = tmp_path / "tok.json"
  tokenizer.save_atomic(tokenizer.byte_tokenizer(), str(path))
  config = text_config(tmp_path, f"tokenizer_path={path}")
  assert tokenizer.load_or_train(config, [])[0].get_vocab_size() == 257
  with pytest.raises(ConfigError, match="vocab_size=200.*257"):
    tokenizer.load_or_train(text_config(tmp_path, f"tokenizer_path={path}", "vocab_size=200"), [])
  # Ids with gaps: 2 tokens, but id 400 is past a 320-row embedding table.
  sparse = Tokenizer(models.WordLevel({"a": 0, tokenizer.EOD: 400}, unk_token=tokenizer.EOD))
  sparse.save(str(tmp_path / "sparse.json"))
  with pytest.raises(ConfigError, match=re.escape("vocab_size=320: smaller than the 401 token ids (0 to 400)")):
    tokenizer.load_or_train(text_config(tmp_path, f"tokenizer_path={tmp_path / 'sparse.json'}"), [])
  (tmp_path / "bad.json").write_text("{not json")
  for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
    with pytest.raises(ConfigError, match=f"tokenizer_path='{bad}'"):
      tokenizer.load_or_train(text_config(tmp_path, f"tokenizer_path={bad}"), [])


@pytest.mark.parametrize("tokenizer_type", ["byte", "bpe"])
def test_a_corpus_too_small_for_one_row_is_one_line_and_caches_nothing(tmp_path, tokenizer_type):
  (tmp_path / "small.txt").write_text("a few words\n" * 3)
  config = text_config(tmp_path, f"dataset_path={tmp_path / 'small.txt'}", f"tokenizer_type={tokenizer_type}")
  with pytest.raises(ConfigError, match="fewer than one row of max_target_length=16"):
    input_pipeline.TextData(config)
  assert not (tmp_path / "cache").exists()  # neither the tokens nor the BPE trained on them


def test_byte_tokenizer_round_trips_any_utf8():
  tok = tokenizer.byte_tokenizer()
  text = "Ça va? 東京 — ok\n\ttabs"
  ids = tok.encode(text).ids
  assert len(ids) == len(text.encode()) and max(ids) < 256
  assert tok.decode(ids) == text and tok.token_to_id(tokenizer.EOD) == 256


def test_packed_rows_never_cross_a_document_boundary():
  eod = 0
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 50, n) for n in (5, 1, 13, 7, 30, 2)]
  stream = np.concatenate([np.append(d, eod) for d in docs]).astype(np.int32)
  rows = input_pipeline.text_rows(stream, 8, eod)
  doc_of = np.cumsum(np.concatenate([[0], stream[:-1] == eod]))  # document index of every token
  pos_of = np.concatenate([np.arange(len(d) + 1) for d in docs])
  for r in range(len(rows)):
    row, start = rows[r], r * 8
    np.testing.assert_array_equal(row["inputs"], stream[start:start + 8])
    np.testing.assert_array_equal(row["targets"], stream[start + 1:start + 9])
    docs_in_row = doc_of[start:start + 8]
    # Same segment id <=> same document; positions count from the document's start.
    same_seg = row["inputs_segmentation"][:, None] == row["inputs_segmentation"][None]
    np.testing.assert_array_equal(same_seg, docs_in_row[:, None] == docs_in_row[None])
    first_doc = docs_in_row == docs_in_row[0]
    expected_pos = np.where(first_doc, np.arange(8), pos_of[start:start + 8])
    np.testing.assert_array_equal(row["inputs_position"], expected_pos)
    # A target is scored only when it belongs to the same document as its input.
    scored = row["targets_segmentation"] != 0
    np.testing.assert_array_equal(scored, doc_of[start + 1:start + 9] == docs_in_row)


def test_text_is_tokenized_once_then_read_from_the_cache(tmp_path, monkeypatch):
  config = text_config(tmp_path)
  first = input_pipeline.TextData(config)
  first.save_caches()
  monkeypatch.setattr(type(first.tokenizer), "encode_batch",
                      lambda *_, **__: pytest.fail("tokenized twice"), raising=False)
  second = input_pipeline.TextData(config)
  np.testing.assert_array_equal(first.train, second.train)
  assert len(first.train) > 1_000_000 and len(first.eval) > 50_000
  assert first.train[-1] == first.eod and np.sum(np.asarray(first.train) == first.eod) == 35


def batches_of(config, data, count):
  iterator = input_pipeline.create_train_iterator(config, data)
  return [next(iterator) for _ in range(count)]


def test_batches_are_shuffled_by_seed_and_resume_from_the_iterator_state(shared):
  config = shared()
  data = load(config)
  batches = batches_of(config, data, 6)
  assert batches[0]["inputs"].shape == (config.global_batch_size_to_train_on, config.max_target_length)
  reseeded = shared("data_shuffle_seed=1")
  assert not np.array_equal(batches[0]["inputs"], batches_of(reseeded, load(reseeded), 1)[0]["inputs"])
  iterator = input_pipeline.create_train_iterator(config, data)
  for _ in range(3):
    next(iterator)
  state = iterator.get_state()
  restored = input_pipeline.create_train_iterator(config, data)
  restored.set_state(state)
  for expected in batches[3:]:
    jax.tree.map(np.testing.assert_array_equal, next(restored), expected)


def test_each_process_loads_its_slice_of_the_global_batch(shared, monkeypatch):
  config = shared()
  data = load(config)
  whole = batches_of(config, data, 2)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  parts = []
  for p in range(2):
    monkeypatch.setattr(jax, "process_index", lambda p=p: p)
    parts.append(batches_of(config, data, 2))
  for step in range(2):
    for key in whole[step]:
      np.testing.assert_array_equal(np.concatenate([parts[0][step][key], parts[1][step][key]]),
                                    whole[step][key])


def test_batches_from_a_step_on_follow_from_the_step_alone_for_any_number_of_processes(shared, monkeypatch):
  config = shared()
  data = load(config)
  assert input_pipeline.resumes_by_step(data)
  whole = batches_of(config, data, 5)[3:]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  parts = []
  for p in range(2):
    monkeypatch.setattr(jax, "process_index", lambda p=p: p)
    iterator = input_pipeline.create_train_iterator(config, data, 3)
    parts.append([next(iterator) for _ in range(2)])
  for step in range(2):
    for key in whole[step]:
      np.testing.assert_array_equal(np.concatenate([parts[0][step][key], parts[1][step][key]]), whole[step][key])


def test_a_damaged_cache_entry_is_rebuilt_not_fatal(tmp_path):
  # A corpus of its own, a few kB: the plays would be tokenized and their BPE trained twice.
  (tmp_path / "corpus.txt").write_text("".join(f"line {i} of a small corpus, enough for rows\n" for i in range(400)))
  config = text_config(tmp_path, f"dataset_path={tmp_path / 'corpus.txt'}")
  first = input_pipeline.TextData(config)
  first.save_caches()
  want_tokenizer, want_train, want_eval = first.tokenizer.to_str(), np.array(first.train), np.array(first.eval)
  caches = sorted(tmp_path.rglob("*.npy")) + sorted(tmp_path.rglob("bpe-*.json"))
  assert [p.suffix for p in caches] == [".npy", ".npy", ".json"]
  for path in caches:  # cut each to half, as a full disk or a bad copy would
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  second = input_pipeline.TextData(config)
  assert second.tokenizer.to_str() == want_tokenizer
  np.testing.assert_array_equal(second.train, want_train)
  np.testing.assert_array_equal(second.eval, want_eval)
