"""Vocabulary tiling against full logits, optax cross entropy and jax.grad."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, fixed_batch, tiny_config, trainer_and_state

from MaxText import sharding, train_step
from MaxText.losses import tiled_token_sums

B, T, D, V = 3, 13, 16, 96  # B*T = 39 tokens: no tile count below divides it evenly


def inputs(seed=0, dtype=jnp.float32, half_weights_zero=True):
  k = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(k[0], (B, T, D), dtype)
  kernel = jax.random.normal(k[1], (D, V)) / np.sqrt(D)
  targets = jax.random.randint(k[2], (B, T), 0, V)
  weights = jnp.ones((B, T))
  if half_weights_zero:
    weights = (jax.random.uniform(k[3], (B, T)) < 0.5).astype(jnp.float32)
  return hidden, kernel, targets, weights


def reference_loss(hidden, kernel, targets, weights, z_loss_multiplier, cap=0.0):
  """The untiled loss, written independently: full float32 logits (soft-capped when cap > 0)
  and optax."""
  logits = hidden.astype(jnp.float32) @ kernel.astype(jnp.float32)
  if cap:
    logits = cap * jnp.tanh(logits / cap)
  cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  z_loss = z_loss_multiplier * jnp.sum(weights * jax.nn.logsumexp(logits, axis=-1) ** 2)
  return jnp.sum(weights * cross_entropy) + z_loss, z_loss


TILES = (1, 2, 3, 4, 7, 8)


@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("z_loss_multiplier, cap", [(0.0, 0.0), (1e-3, 0.0), (1e-3, 1.5)], ids=["plain", "z-loss",
                                                                                               "z-loss, soft cap"])
def test_loss_and_gradients_match_full_logits(mode, z_loss_multiplier, cap):
  """A cap of 1.5 bends logits of scale ~1 well into tanh's curve (Gemma 2's 30 on its logits)."""
  hidden, kernel, targets, weights = inputs()
  # An outer scale: the gradient of 3 * loss must be 3 * the gradient (MaxText once forgot
  # the incoming cotangent for the hidden states).
  reference = jax.value_and_grad(lambda h, w: 3 * reference_loss(h, w, targets, weights, z_loss_multiplier, cap)[0],
                                 argnums=(0, 1))
  want_loss, want_grads = reference(hidden, kernel)
  _, want_z = reference_loss(hidden, kernel, targets, weights, z_loss_multiplier, cap)
  for num_tiles in TILES:
    tiled = jax.jit(jax.value_and_grad(
        lambda h, w, n=num_tiles: 3 * tiled_token_sums(h, w, targets, weights, n, z_loss_multiplier, mode,
                                                       cap)[0], argnums=(0, 1)))
    loss, grads = tiled(hidden, kernel)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"{num_tiles} tiles")
    assert_trees_close(grads, want_grads, rtol=1e-5, what=f"{num_tiles} tiles")
    z = tiled_token_sums(hidden, kernel, targets, weights, num_tiles, z_loss_multiplier, mode, cap)[1]
    np.testing.assert_allclose(z, want_z, rtol=1e-5, atol=1e-7, err_msg=f"{num_tiles} tiles")


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_tied_embeddings_get_the_gradient_through_the_transpose(mode):
  hidden, _, targets, weights = inputs()
  embedding = jax.random.normal(jax.random.key(5), (V, D)) / np.sqrt(D)
  want = jax.grad(lambda h, e: reference_loss(h, e.T, targets, weights, 0.0)[0], argnums=(0, 1))(hidden, embedding)
  got = jax.grad(lambda h, e: tiled_token_sums(h, e.T, targets, weights, 4, mode=mode)[0],
                 argnums=(0, 1))(hidden, embedding)
  assert_trees_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_bfloat16_hidden_states(mode):
  hidden, kernel, targets, weights = inputs(dtype=jnp.bfloat16)
  kernel = kernel.astype(jnp.bfloat16)
  want_loss, want_grads = jax.value_and_grad(
      lambda h, w: reference_loss(h, w, targets, weights, 0.0)[0], argnums=(0, 1))(hidden, kernel)
  loss, grads = jax.value_and_grad(lambda h, w: tiled_token_sums(h, w, targets, weights, 4, mode=mode)[0],
                                   argnums=(0, 1))(hidden, kernel)
  assert loss.dtype == jnp.float32 and grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
  np.testing.assert_allclose(loss, want_loss, rtol=2e-2)
  assert_trees_close(jax.tree.map(lambda x: x.astype(jnp.float32), grads),
                     jax.tree.map(lambda x: x.astype(jnp.float32), want_grads), rtol=2e-2)


def test_accuracy_is_counted_inside_the_tiles():
  hidden, kernel, targets, weights = inputs(half_weights_zero=False)
  logits = hidden @ kernel
  targets = targets.at[0, :5].set(jnp.argmax(logits[0, :5], axis=-1))  # some right answers
  want = jnp.sum(weights * (jnp.argmax(logits, -1) == targets))
  for num_tiles in (1, 5):
    assert tiled_token_sums(hidden, kernel, targets, weights, num_tiles)[2] == want >= 5, f"{num_tiles} tiles"


def test_bad_arguments_are_rejected():
  hidden, kernel, targets, weights = inputs()
  with pytest.raises(ValueError, match="mode"):
    tiled_token_sums(hidden, kernel, targets, weights, 2, mode="lazy")
  with pytest.raises(ValueError, match="num_tiles"):
    tiled_token_sums(hidden, kernel, targets, weights, 0)


def buffer_sizes(hlo_text):
  """Element counts of every array shape in an HLO module's text."""
  return {int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\w+\[([\d,]*)\]", hlo_text)}


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_compiled_train_step_never_holds_full_logits(mode):
  # vocab_size=200 makes B*T*V = 64*200 = 12800 elements, a size no other buffer has.
  untiled = tiny_config("vocab_size=200")
  tiled = tiny_config("vocab_size=200", "num_vocab_tiling=8", f"vocab_tiling_mode={mode}")
  full_logits = untiled.global_batch_size_to_train_on * untiled.max_target_length * untiled.vocab_size
  hlo = {}
  for name, config in (("untiled", untiled), ("tiled", tiled)):
    trainer, _ = trainer_and_state(config)
    hlo[name] = train_step.compile_train_step(trainer, config).as_text()
  assert full_logits in buffer_sizes(hlo["untiled"])  # the check can see full logits...
  assert full_logits not in buffer_sizes(hlo["tiled"])  # ...and tiling removes them


@pytest.mark.parametrize("overrides", [(), ("vocab_tiling_mode=recompute", "logits_via_embedding=true",
                                             "z_loss_multiplier=1e-3", "gradient_accumulation_steps=2",
                                             "per_device_batch_size=2"), ("final_logits_soft_cap=0.05",)])
def test_training_with_tiling_matches_untiled_training(overrides):
  results = {}
  for tiles in (1, 4):
    config = tiny_config(f"num_vocab_tiling={tiles}", *overrides)
    trainer, state = trainer_and_state(config)
    losses, accuracies = [], []
    with sharding.activate(trainer.mesh, config):
      batch = train_step.device_batch(trainer, fixed_batch(config))
      for _ in range(5):
        state, m = trainer.train_step(state, batch)
        losses.append(float(m["learning/loss"]))
        accuracies.append(float(m["learning/accuracy"]))
      evaluated = trainer.eval_step(state.params, train_step.device_batch(trainer, fixed_batch(config, seed=9)))
    results[tiles] = losses, accuracies, jax.device_get(evaluated)
  np.testing.assert_allclose(results[4][0], results[1][0], rtol=1e-5)
  np.testing.assert_allclose(results[4][1], results[1][1], rtol=1e-5)
  assert_trees_close(results[4][2], results[1][2], rtol=1e-5)
  assert results[1][0][-1] < results[1][0][0]
