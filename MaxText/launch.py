"""A command's config from its argv, with what parsing leaves to the command: the checks and
set-up that need the machine, done once, before anything is written."""

from MaxText import accelerators, auto, checkpointing, pyconfig, sharding


def config(argv, plans: bool = False) -> pyconfig.Config:
  """pyconfig.parse(argv), then: load_parameters_path's checksums (before anything is written),
  jax.distributed (before JAX lists its devices), the devices (after which SIGTERM is again the
  default action), and `auto` values, which only the commands that plan (`plans`: train,
  train_compile) resolve."""
  values, auto_keys = pyconfig.parse(argv)
  if not plans:
    pyconfig.refuse_auto(auto_keys)
  if values["load_parameters_path"]:
    checkpointing.parameters_item(values["load_parameters_path"])  # a path that is no checkpoint, named by its key
    checkpointing.check_verified(values["load_parameters_path"], values["trust_unverified_checkpoints"])
  if not values["compile_topology"]:
    sharding.initialize_distributed(values)
  config = pyconfig.for_devices(values)
  accelerators.sigterm_without_stack_dump()
  return auto.resolve(config, auto_keys)
