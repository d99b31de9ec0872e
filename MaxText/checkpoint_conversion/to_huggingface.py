"""A checkpoint -> a Hugging Face model directory:

  python -m MaxText.checkpoint_conversion.to_huggingface configs/base.yml \\
    load_parameters_path=RUN/checkpoints/STEP hf_output_path=DIR [convert_dtype=...]

The model keys are those saved with the checkpoint (to_maxtext's model.yml, or the config.yml
of the run that trained it), or given. Writes config.json and model.safetensors, or above
5 GB shards model-0000K-of-0000N.safetensors with model.safetensors.index.json, as
transformers' save_pretrained does, so AutoModelForCausalLM.from_pretrained(DIR) loads it.
Parameters are read a layer at a time (sliced.py) and each shard is written once full: memory
holds one layer of one parameter and one shard. The directory is written aside and renamed when complete.
"""

import itertools
import json
import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from safetensors.numpy import save_file

from MaxText import checkpointing, errors, launch, run_control, runtime
from MaxText.checkpoint_conversion import mapping, sliced
from MaxText.families import FAMILIES

MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained shards at "5GB"


def _stored(config) -> dict:
  """{parameter path: (shape, dtype)} as the checkpoint stores them."""
  path = config.load_parameters_path
  item = checkpointing.parameters_item(path)
  try:
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item)).tree["params"]
  except Exception as e:  # orbax raises many types for a directory that is not a checkpoint
    raise errors.ConfigError(f"load_parameters_path={path!r}: not a checkpoint with parameters "
                             f"({errors.first_line(e)})") from None
  stored = {}
  for entry in mapping.layout(config):
    node = tree
    for key in entry[0]:
      node = node.get(key) if isinstance(node, dict) else None
    if node is None:
      raise errors.ConfigError(f"load_parameters_path={path!r}: has no parameter {'/'.join(entry[0])} (its model "
                               "keys are not this config's: give them, or model_name)")
    want = entry[2] + entry[3]
    if tuple(node.shape) != want:
      raise errors.ConfigError(f"load_parameters_path={path!r}: parameter {'/'.join(entry[0])} has shape "
                               f"{tuple(node.shape)}, the model keys give {want} (give the checkpoint's keys)")
    stored[entry[0]] = (want, jnp.dtype(config.convert_dtype or node.dtype))
  return stored


def _shards(config, stored: dict, max_shard_bytes: int) -> list:
  """Hugging Face tensor names, grouped into files of at most max_shard_bytes (a larger tensor alone)."""
  shards, size = [[]], 0
  for group in mapping.tensor_groups(config):
    entry = group[0]
    dtype = stored[entry[0]][1]
    nbytes = int(np.prod(mapping.hf_shape(entry))) * dtype.itemsize
    for name in dict.fromkeys(mapping.hf_names(config, entry)):  # once each where the experts share one
      if shards[-1] and size + nbytes > max_shard_bytes:
        shards.append([])
        size = 0
      shards[-1].append(name)
      size += nbytes
  return shards


def _layers(config, entry, dtype):
  """The entry's parameter a layer at a time (all of it if not stacked), as (layer, values in
  `dtype`); its checksums are checked once the last has been read."""
  path = config.load_parameters_path
  try:
    store = sliced.open_array(checkpointing.parameters_item(path), ("params", *entry[0]))
    running = checkpointing.SliceChecksums()
    for layer in range(store.shape[0]) if entry[2] else [None]:
      value = (store[layer] if entry[2] else store).read().result()
      running.add(value)
      yield layer, value.astype(dtype)
  except Exception as e:  # orbax and tensorstore raise many types for a damaged checkpoint
    raise checkpointing.CheckpointError(f"load_parameters_path={path!r}: cannot restore parameters: "
                                        f"{errors.first_line(e)}") from None
  recorded = checkpointing.recorded_checksums(path)
  key = "".join(f"[{key!r}]" for key in entry[0])
  problem = recorded is not None and checkpointing.mismatch(recorded, {key: running.value()})
  if problem:
    raise checkpointing.CheckpointError(f"load_parameters_path={path!r}: {problem}")


def _write(config, stored: dict, shards: dict, directory: str) -> None:
  """Each shard {file: names} written as soon as its last tensor is converted, then config.json."""
  file_of = {name: file for file, names in shards.items() for name in names}
  pending, total = {file: {} for file in shards}, 0
  for group in mapping.tensor_groups(config):
    # The parts of one tensor a layer at a time together: zip_longest runs each to its end,
    # where its checksums are checked.
    for slices in itertools.zip_longest(*(_layers(config, entry, stored[entry[0]][1]) for entry in group)):
      layer = slices[0][0]
      tensors = [mapping.to_hf_tensors(config, entry, param, layer) for entry, (_, param) in zip(group, slices)]
      del slices
      for name, tensor in mapping.joined(group, tensors).items():
        shard = pending[file_of[name]]
        shard[name] = tensor
        total += tensor.nbytes
        if len(shard) == len(shards[file_of[name]]):
          save_file(shard, os.path.join(directory, file_of[name]), metadata={"format": "pt"})
          os.chmod(os.path.join(directory, file_of[name]), 0o644)  # safetensors makes 0600 files; a model is to share
          shard.clear()
      del tensors
  if len(shards) > 1:
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": file_of}, f, indent=2)
  embedding_dtype = stored[mapping.layout(config)[0][0]][1]
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(mapping.hf_config(config, str(embedding_dtype)), f, indent=2)


def convert(config, max_shard_bytes: int = MAX_SHARD_BYTES) -> list:
  """Writes the Hugging Face directory; returns its files. Every check runs before anything is written."""
  if not config.load_parameters_path:
    raise errors.ConfigError("load_parameters_path='': give the checkpoint step directory to export")
  output = config.hf_output_path
  if not output:
    raise errors.ConfigError("hf_output_path='': give a new directory for the Hugging Face model")
  mapping.check_exportable(config)
  run_control.check_writable("hf_output_path", output)
  if os.path.exists(output):
    raise errors.ConfigError(f"hf_output_path={output!r}: exists; give a new directory")
  stored = _stored(config)
  shards = _shards(config, stored, max_shard_bytes)
  files = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
  parent = os.path.dirname(os.path.abspath(output))
  os.makedirs(parent, exist_ok=True)
  partial = run_control.staging_dir(parent, f"{os.path.basename(os.path.abspath(output))}.to_huggingface")
  try:
    _write(config, stored, dict(zip(files, shards)), partial)
  except BaseException:
    shutil.rmtree(partial)
    raise
  os.replace(partial, output)
  return files


def main(argv):
  with run_control.signals_raise():
    config = launch.config(mapping.tool_argv(argv[1:]))
    files = convert(config)
  print(f"wrote {config.load_parameters_path} to {config.hf_output_path} ({len(files)} safetensors file(s), "
        f"Hugging Face {FAMILIES[config.decoder_block].hf_architecture})", file=sys.stderr)


if __name__ == "__main__":
  runtime.run(main)
