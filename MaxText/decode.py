"""Sampling: python -m MaxText.decode configs/base.yml load_parameters_path=DIR prompt="..." max_decode_length=N

Prints the prompt and its continuation. Parameters come from load_parameters_path, or else
from the latest checkpoint of run_name. Each new token runs the model over the last
max_target_length tokens (no KV cache: simple, and fast enough for the models that train here).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from MaxText import checkpointing, errors, pyconfig
from MaxText.input_pipeline import input_pipeline
from MaxText.layers.models import Transformer


def _parameters_path(config) -> str:
  path = config.load_parameters_path or checkpointing.latest_checkpoint(config)
  if not path:
    raise errors.ConfigError(f"load_parameters_path='': and run {config.run_dir} has no checkpoint to load")
  return path


def generate(config) -> str:
  run_tokenizer = os.path.join(config.run_dir, "tokenizer.json")
  # The tokenizer the run trained with, which train keeps in its directory; else the flags'.
  tokenizer = (Tokenizer.from_file(run_tokenizer) if os.path.exists(run_tokenizer) and not config.load_parameters_path
               else input_pipeline.load(config).tokenizer)
  if tokenizer is None:
    raise errors.ConfigError(f"dataset_type={config.dataset_type!r}: has no tokenizer to decode with "
                             "(use the dataset_type the model was trained with)")
  model = Transformer(config)
  length = config.max_target_length
  params = checkpointing.load_model_parameters(config, _parameters_path(config))

  @jax.jit
  def next_token(tokens, last, key):
    positions = jnp.arange(length)[None]
    logits = model.apply({"params": params}, tokens, positions, jnp.ones_like(tokens))[0, last]
    if config.decode_sampling_strategy == "greedy":
      return jnp.argmax(logits)
    return jax.random.categorical(key, logits / config.decode_sampling_temperature)

  prompt = tokenizer.encode(config.prompt, add_special_tokens=False).ids
  if not prompt:
    raise errors.ConfigError("prompt='': give some text to continue")
  tokens = list(prompt)
  key = jax.random.key(config.decode_sampling_seed)
  for i in range(config.max_decode_length):
    context = tokens[-length:]
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(context)] = context
    tokens.append(int(next_token(padded, len(context) - 1, jax.random.fold_in(key, i))))
  return config.prompt + tokenizer.decode(tokens[len(prompt):])


def main(argv):
  print(generate(pyconfig.initialize(argv[1:])))


if __name__ == "__main__":
  errors.run(main)
