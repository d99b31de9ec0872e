"""Ahead-of-time memory sizing: python -m MaxText.train_compile configs/base.yml [key=value ...]

Lowers and compiles exactly the train step that `MaxText.train` runs (same config, same
mesh, same shardings) for the visible devices, runs nothing, and prints the compiled
per-device memory. To size a mesh larger than this machine, simulate devices on CPU:
JAX_NUM_CPU_DEVICES=256 python -m MaxText.train_compile ... ici_fsdp_parallelism=256
"""

import json

from absl import app

from MaxText import metrics, pyconfig, sharding, train


def main(argv):
  with pyconfig.errors_to_exit_codes():
    config = pyconfig.initialize(argv[1:])
  trainer = train.build(config, sharding.create_mesh(config))
  compiled = train.compile_train_step(trainer, config)
  stats = metrics.memory_stats(compiled)
  print(f"train step memory per device ({config.num_devices} devices, mesh {config.mesh_shape}):")
  print(metrics.format_memory_stats(stats))
  vocab_arrays = metrics.largest_vocab_arrays(compiled, config.vocab_size, config.num_devices)
  print("largest arrays with a vocabulary dimension, per device:")
  print("\n".join(f"  {shape:28s} {size / 2**20:12,.1f} MiB" for shape, size in vocab_arrays))
  if config.memory_stats_file:
    with open(config.memory_stats_file, "w") as f:
      json.dump({**stats, "largest_vocab_arrays": vocab_arrays}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
