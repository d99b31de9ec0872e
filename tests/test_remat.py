"""Remat policies and every-N-th-layer checkpointing: the gradients of `none`, less memory, clear errors."""

import jax
import numpy as np
import pytest
from conftest import assert_trees_close, fixed_batch, on_devices, tiny_config, trainer_and_state

from MaxText import costs, objective, remat, sharding, train_step

# docs/design/remat.md states this tolerance.
RTOL = 1e-5
# Enough activations per layer (32 tokens x 8 rows) for the policies' differences to show.
MODEL = ("base_num_decoder_layers=4", "max_target_length=32", "per_device_batch_size=8")
CUSTOM_QKV = ("remat_policy=custom", "query_proj=device", "key_proj=device", "value_proj=device")
VARIANTS = {
    "none, loop": ("remat_policy=none", "scan_layers=false"),
    **{policy: (f"remat_policy={policy}",) for policy in remat.SEARCHABLE_POLICIES},
    "custom qkv": CUSTOM_QKV,
    "custom mixed": ("remat_policy=custom", "attention_out=device", "mlpwi_0=offload", "decoder_layer_input=offload"),
    "full, interval 2": ("remat_policy=full", "remat_layer_interval=2"),
    "full, interval 3": ("remat_policy=full", "remat_layer_interval=3"),
    "full, interval 4": ("remat_policy=full", "remat_layer_interval=4"),
    "minimal, interval 4": ("remat_policy=minimal", "remat_layer_interval=4"),
    "full, interval 3, loop": ("remat_policy=full", "remat_layer_interval=3", "scan_layers=false"),
    "full, loop": ("remat_policy=full", "scan_layers=false"),
    "minimal, loop": ("remat_policy=minimal", "scan_layers=false"),
}


@pytest.fixture(scope="module")
def gradients():
  """jax.grad of the summed training loss for every variant, from the same parameters on the same
  batch, no optimizer: {name: (the compiled gradient's temp bytes, loss, gradients)}."""
  reference_config = tiny_config(*MODEL, "scan_layers=false", "remat_policy=none")
  _, reference_state = trainer_and_state(reference_config)
  params = jax.device_get(reference_state.params)
  batch = fixed_batch(reference_config)
  results = {}
  for name, overrides in VARIANTS.items():
    config = tiny_config(*MODEL, *overrides)
    trainer = train_step.build(config, sharding.create_mesh(config))
    loss_and_grads = jax.jit(jax.value_and_grad(
        lambda p, b, model=trainer.model, config=config: objective.batch_sums(model, config, p, b)[0]))
    with sharding.activate(trainer.mesh, config):
      args = (jax.device_put(params, trainer.state_sharding.params), train_step.device_batch(trainer, batch))
      compiled = loss_and_grads.lower(*args).compile()
      loss, grads = compiled(*args)
    results[name] = (costs.memory_stats(compiled)["temp_bytes"], float(loss), jax.device_get(grads))
  return results


@pytest.mark.slow
def test_every_policy_and_interval_gives_the_loss_and_gradients_of_none(gradients):
  _, want_loss, want_grads = gradients["none, loop"]
  for name, (_, loss, grads) in gradients.items():
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, err_msg=name)
    assert_trees_close(grads, want_grads, rtol=RTOL, what=name)


def test_every_policy_saves_memory_in_the_documented_order(gradients):
  temp = {name: r[0] for name, r in gradients.items()}
  assert temp["none"] > temp["minimal"] > temp["save_qkv_proj"] > temp["full"]
  for name, value in temp.items():
    if not name.startswith("none"):
      assert value < temp["none"], name  # a missing checkpoint_name would leave it at `none`
  # Fewer checkpointed layers keep more: 1 of 4, then 2 of 4, then all.
  assert temp["none"] > temp["full, interval 4"] > temp["full, interval 2"] > temp["full"]
  assert temp["none"] > temp["full, interval 3"] > temp["full"]  # layers 0 and 3 (a leftover group)
  assert temp["custom qkv"] == temp["save_qkv_proj"]
  # The same in a Python-loop stack.
  assert temp["none, loop"] > temp["minimal, loop"] > temp["full, loop"]


def scan_lengths(jaxpr) -> list:
  """The trip counts of every scan in a jaxpr, nested ones included."""
  lengths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      lengths.append(eqn.params["length"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
          lengths += scan_lengths(getattr(sub, "jaxpr", sub))
  return lengths


@pytest.mark.parametrize("interval, groups", [(1, 4), (2, 2), (3, 1)])
def test_interval_groups_are_scanned_not_unrolled(interval, groups):
  """One scan over depth // interval blocks (forward and backward), nothing longer."""
  config = tiny_config(*MODEL, f"remat_layer_interval={interval}", "remat_policy=full")
  trainer = train_step.build(config, sharding.create_mesh(config))  # traced only: no state compiled
  lengths = scan_lengths(train_step.trace_train_step(trainer, config).jaxpr)
  assert lengths.count(groups) >= 2 and max(lengths) == groups, lengths


@pytest.mark.parametrize("offloaded, on_device", [("input_offloaded", "full"),
                                                  ("save_out_proj_input_offloaded", "save_out_proj")])
def test_offloading_the_layer_input_changes_no_loss_or_gradient(gradients, offloaded, on_device):
  _, want_loss, want_grads = gradients[on_device]
  _, loss, grads = gradients[offloaded]
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=offloaded)
  assert_trees_close(grads, want_grads, rtol=1e-5, what=offloaded)


def test_keeping_attention_out_keeps_its_kernel_residuals_so_no_matmul_is_recomputed():
  """A custom policy that keeps every named tensor recomputes no matmul, the attention kernel's
  forward included (its backward needs the logsumexp beside the context, remat.KERNEL_RESIDUALS):
  the traced FLOPs equal `none`'s. Context 2, whose attention blocks are XLA dots the count sees."""
  def traced(*policy):
    config = tiny_config("ici_context_parallelism=2", "attention=chunked", "attention_chunk_size=8", *policy)
    return costs.matmul_flops(train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)),
                                                          config).jaxpr)

  with on_devices(2):
    kept = traced("remat_policy=custom", *(f"{name}=device" for name in remat.TENSOR_NAMES))
    assert kept == traced("remat_policy=none")
