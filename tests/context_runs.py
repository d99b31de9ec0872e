"""Loss gradients of tiny models under context parallelism; run with JAX_NUM_CPU_DEVICES=8.

python tests/context_runs.py OUT_DIR writes OUT_DIR/<variant>.npz for every entry of
conftest.CONTEXT_VARIANTS: the summed loss ("loss") and its gradients for the initial
parameters on conftest.packed_batch.
"""

import os
import sys

import numpy as np
from conftest import CONTEXT_MODELS, CONTEXT_VARIANTS, loss_gradients, packed_batch, tiny_config


def main(out):
  for name, (model, overrides) in CONTEXT_VARIANTS.items():
    config = tiny_config(*CONTEXT_MODELS[model], "per_device_batch_size=0.25", *overrides)
    np.savez(os.path.join(out, f"{name.replace(' ', '_')}.npz"), **loss_gradients(config, packed_batch(config)))


if __name__ == "__main__":
  main(sys.argv[1])
