"""Hugging Face model directory -> a parameters checkpoint:

  python -m MaxText.checkpoint_conversion.to_maxtext configs/base.yml hf_model_path=DIR \\
    base_output_directory=OUT run_name=R [model_name=NAME] [convert_dtype=...]

writes OUT/R/checkpoints/0 (orbax, layers stacked as every run stores them) with model.yml,
the resolved model keys, beside the arrays; `load_parameters_path=OUT/R/checkpoints/0` then
starts a run (of another run_name) or a decode from it, with those keys. Without model_name
every model key comes from config.json; with it, config.json must agree (a mismatch is one
line naming the key). Tensors are read, converted and saved one layer of one parameter at a
time (sliced.py), into a directory renamed into place only when complete.
"""

import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import yaml

from MaxText import checkpointing, errors, pyconfig, run_control, runtime
from MaxText.checkpoint_conversion import mapping, sliced
from MaxText.families import FAMILIES


def resolve_config(argv):
  """The config of argv with, unless it names a model_name, every model key from config.json."""
  argv = mapping.tool_argv(argv)
  # The model keys given are checked with config.json's under them, not with base.yml's defaults
  # (n_routing_groups=4 given for a model whose config.json names its topk_group).
  given_model_keys = lambda arg: arg.partition("=")[0] in pyconfig.MODEL_KEYS
  first = pyconfig.initialize([argv[0], *(arg for arg in argv[1:] if not given_model_keys(arg))])
  if not first.hf_model_path:
    raise errors.ConfigError("hf_model_path='': give the Hugging Face model directory to import")
  hf = mapping.read_config(first.hf_model_path)
  if first.model_name == "default":
    keys = mapping.model_keys(hf, first.hf_model_path)
    # Whole floats as integers: config.json writes rope_theta 10000.0 for the integer key rope_max_timescale.
    config = pyconfig.initialize([argv[0], *(f"{k}={int(v) if isinstance(v, float) and v.is_integer() else v}"
                                             for k, v in keys.items() if v is not None), *argv[1:]])
  else:
    config = pyconfig.initialize(argv)
  mapping.check_shape(config, hf, config.hf_model_path)
  return config


def _write(config, tensors: dict, dtype, path: str, check) -> None:
  """The checkpoint, each parameter a layer at a time as it is written (sliced.save), its
  checksums (as a run's, so every reader verifies it), then model.yml; check() before each layer
  (run_control.signals_deferred's)."""
  tree, sums = {}, {}
  for entry in (entry for entry in mapping.layout(config) if not entry.copy):
    keys, stack, shape = entry.path, entry.stack, entry.shape
    running = sums[".params" + "".join(f"[{key!r}]" for key in keys)] = checkpointing.SliceChecksums()

    def read(layer, entry=entry, running=running):
      check()
      bad = []  # training from it would stop at its first step, naming nothing

      def read_tensor(name, region=None):
        tensor = mapping.read_tensor(tensors, name, region)
        if not np.isfinite(np.asarray(tensor, np.float32)).all():
          bad.append(name)
        return tensor

      value = mapping.to_param(config, entry, read_tensor, dtype, layer)
      if bad:
        raise errors.ConfigError(f"hf_model_path={config.hf_model_path!r}: tensor {', '.join(bad)} holds values "
                                 "that are not finite (inf or nan)")
      running.add(value)
      return value

    node = tree
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    stored = mapping.tensor_dtype(tensors, mapping.hf_names(config, entry)[0])
    node[keys[-1]] = sliced.Slices(stack + shape, dtype or stored, len(stack), read)
  sliced.save(path, {"params": tree})
  checkpointing.write_checksums(path, {key: running.value() for key, running in sums.items()})
  with open(os.path.join(path, pyconfig.MODEL_KEYS_FILE), "w") as f:
    yaml.safe_dump({key: getattr(config, key) for key in pyconfig.MODEL_KEYS}, f, sort_keys=False)


def convert(config) -> str:
  """Writes the checkpoint; returns its path. Every check runs before anything is written."""
  output = os.path.abspath(os.path.join(config.run_dir, "checkpoints", "0"))
  run_control.check_writable("base_output_directory", output)
  if os.path.exists(output):
    raise errors.ConfigError(f"run_name={config.run_name!r}: {output} exists; pick a new run_name")
  # A run's own checkpoints: a step 0 of another model among them would be pruned, or resumed from.
  steps = sorted(n for n in os.listdir(os.path.dirname(output)) if n.isdigit()) if os.path.isdir(
      os.path.dirname(output)) else []
  if steps:
    raise errors.ConfigError(f"run_name={config.run_name!r}: run {config.run_dir} has checkpoints (steps "
                             f"{', '.join(steps)}); import into a new run_name")
  dtype = jnp.dtype(config.convert_dtype) if config.convert_dtype else None
  tensors = mapping.tensor_index(config.hf_model_path)
  mapping.check_tensors(config, tensors, config.hf_model_path)
  new = os.path.dirname(output)  # the outermost directory this conversion makes, if any
  while not os.path.exists(os.path.dirname(new)):
    new = os.path.dirname(new)
  created = not os.path.exists(new)
  os.makedirs(os.path.dirname(output), exist_ok=True)
  staging = run_control.staging_dir(os.path.dirname(output), "to_maxtext")
  checkpointing.quiet_orbax_tracebacks()  # a bad tensor is one line, not each writer thread's traceback
  with run_control.signals_deferred() as check:
    try:
      _write(config, tensors, dtype, os.path.join(staging, "0"), check)
      check()
    except BaseException:  # a tensor found bad, or a signal, while written: nothing of the conversion stays
      shutil.rmtree(new if created else staging)
      raise
    os.replace(os.path.join(staging, "0"), output)
    os.rmdir(staging)
  return output


def main(argv):
  with run_control.signals_raise():
    config = resolve_config(argv[1:])
    output = convert(config)
  print(f"wrote {config.hf_model_path} ({FAMILIES[config.decoder_block].hf_architecture}) to {output}; start a run "
        f"from it with load_parameters_path={output}", file=sys.stderr)


if __name__ == "__main__":
  runtime.run(main)
