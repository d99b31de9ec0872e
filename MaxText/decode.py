"""Sampling: python -m MaxText.decode configs/base.yml load_parameters_path=DIR prompt="..." max_decode_length=N

Prints the prompt and its continuation. Parameters come from load_parameters_path, or else
from the latest checkpoint of run_name. Each new token runs the model over the last
max_target_length tokens (no KV cache: simple, and fast enough for the models that train here).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import checkpointing, errors, launch, runtime
from MaxText.input_pipeline import input_pipeline
from MaxText.input_pipeline import tokenizer as tokenizers
from MaxText.layers.models import Transformer


def _parameters_path(config) -> str:
  path = config.load_parameters_path or checkpointing.latest_checkpoint(config)
  if not path:
    raise errors.ConfigError(f"load_parameters_path='': and run {config.run_dir} has no checkpoint to load")
  return path


def _tokenizer(config):
  """(tokenizer, where it came from): the one the parameters were trained with, which train
  keeps in their run's directory (load_parameters_path's run: checkpoints/STEP/../..), else
  the flags'."""
  run_dir = os.path.join(config.load_parameters_path, "..", "..") if config.load_parameters_path else config.run_dir
  path = os.path.normpath(os.path.join(run_dir, "tokenizer.json"))
  if os.path.isfile(path):
    return tokenizers.read(path, f"{path}, the tokenizer of the run that trained the parameters"), path
  tokenizer = input_pipeline.load(config).tokenizer
  if tokenizer is None:
    raise errors.ConfigError(f"dataset_type={config.dataset_type!r}: has no tokenizer to decode with "
                             "(use the dataset_type the model was trained with)")
  return tokenizer, "the tokenizer of the data flags"


def _check_not_destroyed(params, path: str) -> None:
  """A checkpoint whose arrays are all zero or not finite restores without an error and would
  decode to one repeated token: refused, naming it."""
  leaves = jax.tree.leaves(params)
  if not all(bool(jnp.isfinite(p).all()) for p in leaves) or not any(bool(p.any()) for p in leaves):
    raise checkpointing.CheckpointError(f"{path}: its parameters are all zero or not finite; the checkpoint is "
                                        "damaged")


def generate(config) -> str:
  if not config.prompt:  # before the flags' tokenizer, which may tokenize the whole corpus
    raise errors.ConfigError("prompt='': give some text to continue")
  tokenizer, source = _tokenizer(config)
  tokenizers.check_vocab_size(tokenizer, config.vocab_size, source)
  model = Transformer(config)
  length = config.max_target_length
  path = _parameters_path(config)
  params = checkpointing.load_model_parameters(config, path)
  _check_not_destroyed(params, path)

  @jax.jit
  def next_token(tokens, last, key):
    positions = jnp.arange(length)[None]
    logits = model.apply({"params": params}, tokens, positions, jnp.ones_like(tokens))[0, last]
    if config.decode_sampling_strategy == "greedy":
      return jnp.argmax(logits)
    return jax.random.categorical(key, logits / config.decode_sampling_temperature)

  prompt = tokenizer.encode(config.prompt, add_special_tokens=False).ids
  if not prompt:
    raise errors.ConfigError(f"prompt={config.prompt!r}: the tokenizer ({source}) gives no tokens for it")
  tokens = list(prompt)
  key = jax.random.key(config.decode_sampling_seed)
  for i in range(config.max_decode_length):
    context = tokens[-length:]
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(context)] = context
    tokens.append(int(next_token(padded, len(context) - 1, jax.random.fold_in(key, i))))
  return config.prompt + tokenizer.decode(tokens[len(prompt):])


def main(argv):
  print(generate(launch.config(argv[1:])))


if __name__ == "__main__":
  runtime.run(main)
