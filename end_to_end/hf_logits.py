"""python end_to_end/hf_logits.py CHECKPOINT TOKENS.npz [--reference REF.npz] [--save OUT.npz]

The float32 logits of the model in CHECKPOINT (a step directory; the model keys saved with it)
on the `tokens` rows of TOKENS.npz. --save writes them (with the tokens) for a later
comparison; --reference compares them with REF.npz's `logits` and exits 1 when any differs by
more than 1e-5 of REF's largest logit (the parity bound of tests/test_hf_checkpoint.py).
"""

import argparse
import os
import sys

import numpy as np

from MaxText import checkpointing, pyconfig
from MaxText.checkpoint_conversion import mapping
from MaxText.layers.models import Transformer

BASE_YML = os.path.join(os.path.dirname(__file__), "..", "configs", "base.yml")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("checkpoint")
  parser.add_argument("tokens")
  parser.add_argument("--reference")
  parser.add_argument("--save")
  args = parser.parse_args()
  tokens = np.load(args.tokens)["tokens"]
  config = pyconfig.initialize([BASE_YML, mapping.NO_DATA, f"load_parameters_path={args.checkpoint}",
                                f"max_target_length={tokens.shape[1]}"])
  params = checkpointing.load_model_parameters(config, args.checkpoint)
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  logits = np.asarray(Transformer(config).apply({"params": params}, tokens, positions, np.ones_like(tokens)))
  if args.save:
    np.savez(args.save, tokens=tokens, logits=logits)
  if args.reference:
    reference = np.load(args.reference)["logits"]
    error = np.abs(logits - reference).max() / np.abs(reference).max()
    print(f"{args.checkpoint}: logits within {error:.2g} of {args.reference}'s largest")
    return int(error > 1e-5)
  return 0


if __name__ == "__main__":
  sys.exit(main())
