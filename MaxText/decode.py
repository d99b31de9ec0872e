"""Sampling: python -m MaxText.decode configs/base.yml load_parameters_path=DIR prompt="..." max_decode_length=N

Prints the prompt and its continuation. Parameters come from load_parameters_path, or else
from the latest checkpoint of run_name. Each new token runs the model over the last
max_target_length tokens (no KV cache: simple, and fast enough for the models that train here).
"""

import logging
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


def degenerate(tokens: list, chosen: list, spreads: list, vocab_size: int) -> str | None:
  """What is wrong with a continuation of the same token at every step, chosen with probability
  near 1 each time (chosen) or from a flat distribution (spreads: each step's largest less
  smallest probability), as a model whose parameters are damaged but finite gives; None
  otherwise (a continuation of several tokens, or one a trained model is sure of only at times)."""
  if len(tokens) < 2 or len(set(tokens)) > 1:
    return None
  if min(chosen) >= 0.99:
    return f"token {tokens[0]} at every step with probability at least {min(chosen):.3f}"
  if max(spreads) <= 1e-3 / vocab_size:
    return f"token {tokens[0]} at every step from a flat distribution (every token's probability 1/{vocab_size})"
  return None


def continuation(config, params, prompt: list) -> list:
  """The tokens that follow `prompt` (token ids) under `params`; a degenerate continuation is
  logged as a warning (degenerate)."""
  model = Transformer(config)
  length = config.max_target_length

  @jax.jit
  def next_token(tokens, last, key):
    positions = jnp.arange(length)[None]
    logits = model.apply({"params": params}, tokens, positions, jnp.ones_like(tokens))[0, last]
    if config.decode_sampling_strategy == "greedy":
      token = jnp.argmax(logits)
    else:
      token = jax.random.categorical(key, logits / config.decode_sampling_temperature)
    probs = jax.nn.softmax(logits.astype(jnp.float32))
    return token, probs[token], jnp.max(probs) - jnp.min(probs)

  tokens, chosen, spreads = list(prompt), [], []
  key = jax.random.key(config.decode_sampling_seed)
  for i in range(config.max_decode_length):
    context = tokens[-length:]
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(context)] = context
    token, probability, spread = next_token(padded, len(context) - 1, jax.random.fold_in(key, i))
    tokens.append(int(token))
    chosen.append(float(probability))
    spreads.append(float(spread))
  problem = degenerate(tokens[len(prompt):], chosen, spreads, config.vocab_size)
  if problem:
    logging.warning("decode: the model gives %s: its parameters may be damaged or untrained", problem)
  return tokens[len(prompt):]


def generate(config) -> str:
  if not config.prompt:  # before the flags' tokenizer, which may tokenize the whole corpus
    raise errors.ConfigError("prompt='': give some text to continue")
  tokenizer, source = _tokenizer(config)
  tokenizers.check_vocab_size(tokenizer, config.vocab_size, source)
  path = _parameters_path(config)
  params = checkpointing.load_model_parameters(config, path)
  _check_not_destroyed(params, path)
  prompt = tokenizer.encode(config.prompt, add_special_tokens=False).ids
  if not prompt:
    raise errors.ConfigError(f"prompt={config.prompt!r}: the tokenizer ({source}) gives no tokens for it")
  return config.prompt + tokenizer.decode(continuation(config, params, prompt))


def main(argv):
  print(generate(launch.config(argv[1:])))


if __name__ == "__main__":
  runtime.run(main)
