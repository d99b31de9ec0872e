"""Tokenizers, all Hugging Face `tokenizers` objects with an end-of-document token.

- tokenizer_path=PATH: any HF tokenizer.json, or a Hugging Face model directory holding one.
- tokenizer_type=bpe: a byte-level BPE trained at vocab_size on the training documents the
  first time, then cached under dataset_cache_dir, keyed by corpus and vocab size.
- tokenizer_type=byte: the 256 byte symbols and the end-of-document token (a BPE with no
  merges), 257 ids.
"""

import hashlib
import os

from absl import logging
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from MaxText.errors import ConfigError, first_line

EOD = "<|endoftext|>"
# End-of-document tokens of common tokenizers, tried in order for a tokenizer_path.
EOD_CANDIDATES = (EOD, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def fingerprint(texts) -> str:
  digest = hashlib.sha256()
  for text in texts:
    digest.update(hashlib.sha256(text.encode()).digest())
  return digest.hexdigest()[:16]


def _byte_level(model) -> Tokenizer:
  tokenizer = Tokenizer(model)
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def byte_tokenizer() -> Tokenizer:
  symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
  tokenizer = _byte_level(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
  tokenizer.add_special_tokens([EOD])
  return tokenizer


def train_bpe(documents, vocab_size) -> Tokenizer:
  tokenizer = _byte_level(models.BPE())
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(documents, trainer)
  return tokenizer


def save_atomic(tokenizer: Tokenizer, path: str) -> None:
  """Writes then renames, so a concurrent or killed run never reads half a file."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  tokenizer.save(tmp)
  os.replace(tmp, path)


def read(path: str, source: str) -> Tokenizer:
  """The tokenizer.json at `path`; a missing or malformed file is a ConfigError naming `source`."""
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises bare Exceptions for missing and malformed files.
    raise ConfigError(f"{source}: cannot load a tokenizer.json ({first_line(e)})") from None


def check_vocab_size(tokenizer: Tokenizer, vocab_size: int, source: str) -> None:
  """ConfigError unless every token id of `tokenizer` is below vocab_size: ids past the
  embedding table would make the loss NaN. Its largest id, not its count: ids may have gaps."""
  ids = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
  if ids > vocab_size:
    raise ConfigError(f"vocab_size={vocab_size}: smaller than the {ids} token ids (0 to {ids - 1}) of {source}")


def eod_id(tokenizer: Tokenizer, source: str) -> int:
  for token in EOD_CANDIDATES:
    token_id = tokenizer.token_to_id(token)
    if token_id is not None:
      return token_id
  raise ConfigError(f"{source}: has no end-of-document token (one of {', '.join(EOD_CANDIDATES)})")


def from_config(config, train_documents) -> tuple[Tokenizer, str, str | None]:
  """(the tokenizer the config asks for, the words naming where it came from, the cache path
  where a BPE trained here is to be saved once the run is accepted, else None)."""
  unsaved = None
  if config.tokenizer_path:
    path = config.tokenizer_path
    if os.path.isdir(path):  # a Hugging Face model directory
      path = os.path.join(path, "tokenizer.json")
    tokenizer = read(path, f"tokenizer_path={config.tokenizer_path!r}")
    source = f"tokenizer_path={config.tokenizer_path!r}"
  elif config.tokenizer_type == "byte":
    tokenizer, source = byte_tokenizer(), "tokenizer_type='byte'"
  else:
    path = os.path.join(config.dataset_cache_dir,
                        f"bpe-{fingerprint(train_documents)}-{config.vocab_size}.json")
    tokenizer = None
    if os.path.isfile(path):
      try:
        tokenizer = Tokenizer.from_file(path)
      except Exception as e:  # written atomically, so damaged after the fact: train it again
        logging.warning("tokenizer cache %s is unreadable (%s); training it again", path, first_line(e))
    if tokenizer is None:
      tokenizer, unsaved = train_bpe(train_documents, config.vocab_size), path
    source = f"tokenizer {path}"
  return tokenizer, source, unsaved


def load_pretrained(config, user: str) -> Tokenizer:
  """tokenizer_path's or the byte tokenizer, for `user`, which cannot train a BPE: that would
  read the whole corpus first."""
  if not config.tokenizer_path and config.tokenizer_type == "bpe":
    raise ConfigError(f"tokenizer_type='bpe': {user} does not train tokenizers (that would read the whole corpus "
                      "first); give tokenizer_path=tokenizer.json or tokenizer_type=byte")
  tokenizer, source, _ = from_config(config, [])
  eod_id(tokenizer, source)
  return tokenizer


def load_or_train(config, train_documents) -> tuple[Tokenizer, str | None]:
  """(The tokenizer the config asks for, where to cache it once the run is accepted: a refused
  start writes nothing; None when it was read from a file). Larger than vocab_size is a config
  error."""
  tokenizer, source, unsaved = from_config(config, train_documents)
  check_vocab_size(tokenizer, config.vocab_size, source)
  eod_id(tokenizer, source)
  return tokenizer, unsaved
