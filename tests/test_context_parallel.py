"""Context parallelism: both strategies, balanced or not, on 2 to 8 context shards, give the
one-device loss and gradients on packed documents, with GQA and Gemma 2's window and soft cap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  assert_trees_close,
  loss_gradients,
  on_devices,
  run_command,
  tiny_config,
  trainer_and_state,
)
from jax.sharding import PartitionSpec as P

from MaxText import costs, errors, sharding, train_step
from MaxText.layers import context_parallel


def packed_batch(config, seed=0):
  """Two rows of packed documents: row 0's boundaries fall inside a context shard (5) and on
  one (16), row 1's inside (13), then two padding tokens; positions restart per document and
  each document's last token is not scored."""
  length = config.max_target_length
  rows = [[5, 11, length - 16], [13, length - 15, 2]]
  segments = np.stack([np.repeat(np.arange(1, 4), row) for row in rows]).astype(np.int32)
  segments[1, -2:] = 0
  positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in rows]).astype(np.int32)
  tokens = np.random.default_rng(seed).integers(0, config.vocab_size, segments.shape, dtype=np.int32)
  targets = np.roll(tokens, -1, axis=1)
  scored = (segments == np.roll(segments, -1, axis=1)) & (segments != 0)
  scored[:, -1] = False
  batch = {"inputs": tokens, "targets": targets, "inputs_position": positions, "inputs_segmentation": segments,
           "targets_segmentation": (segments * scored).astype(np.int32)}
  return {k: np.tile(x, (config.global_batch_size_to_train_on // 2, 1)) for k, x in batch.items()}


# Context parallelism's test models (TINY, GQA 4/2, at 32 tokens) and the meshes of 8 devices
# they run under, each against the model on one device.
CONTEXT_MODELS = {
    "llama": ("max_target_length=32",),
    "gemma2": ("max_target_length=32", "decoder_block=gemma2", "sliding_window_size=6",
               "attn_logits_soft_cap=50", "query_pre_attn_scalar=8"),
}
_RING, _UNBALANCED = "context_parallel_strategy=ring", "context_parallel_load_balance=false"
_C4F2 = ("ici_context_parallelism=4", "ici_fsdp_parallelism=2")
CONTEXT_VARIANTS = {  # name -> (model, overrides)
    "context=2 fsdp=2 tensor=2 all_gather": ("llama", ("ici_context_parallelism=2", "ici_fsdp_parallelism=2",
                                                       "ici_tensor_parallelism=2")),
    "context=4 tensor=2 ring": ("llama", ("ici_context_parallelism=4", "ici_fsdp_parallelism=1",
                                          "ici_tensor_parallelism=2", _RING)),
    "context=8 all_gather": ("llama", ("ici_context_parallelism=8", "ici_fsdp_parallelism=1")),
    "context=8 ring unbalanced": ("llama", ("ici_context_parallelism=8", "ici_fsdp_parallelism=1", _RING,
                                            _UNBALANCED)),
    "context=4 fsdp=2 ring": ("llama", (*_C4F2, _RING)),
    "gemma2 context=4 fsdp=2 ring": ("gemma2", (*_C4F2, _RING)),
    "gemma2 context=4 fsdp=2 all_gather unbalanced chunked": ("gemma2", (*_C4F2, _UNBALANCED, "attention=chunked",
                                                                         "attention_chunk_size=4")),
    # 2 query chunks x 2 key blocks per ring step (8 tokens a shard).
    "context=4 fsdp=2 ring chunked": ("llama", (*_C4F2, _RING, "attention=chunked", "attention_chunk_size=4")),
}


@pytest.fixture(scope="module")
def initial_params():
  """{model: its initial parameters on this process's single device}: the meshes start from them
  (a model initialised on a context mesh is tested in test_sharding)."""
  return {model: jax.device_get(trainer_and_state(tiny_config(*overrides, "per_device_batch_size=2"))[1].params)
          for model, overrides in CONTEXT_MODELS.items()}


@pytest.fixture(scope="module")
def context_results(initial_params):
  """{variant: the summed loss and its gradients at initial_params on packed_batch} on 8 devices."""
  results = {}
  with on_devices(8):
    for name, (model, overrides) in CONTEXT_VARIANTS.items():
      config = tiny_config(*CONTEXT_MODELS[model], "per_device_batch_size=0.25", *overrides)
      results[name] = loss_gradients(config, packed_batch(config), params=initial_params[model])
  return results


@pytest.fixture(scope="module")
def one_device(initial_params):
  """{model: loss and gradients} on this process's single device, the same two rows."""
  results = {}
  for model, overrides in CONTEXT_MODELS.items():
    config = tiny_config(*overrides, "per_device_batch_size=2")
    results[model] = loss_gradients(config, packed_batch(config), params=initial_params[model])
  return results


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(CONTEXT_VARIANTS))
def test_context_parallel_loss_and_gradients_equal_one_device(context_results, one_device, variant):
  assert_trees_close(context_results[variant], one_device[CONTEXT_VARIANTS[variant][0]], rtol=1e-5, what=variant)


def test_balanced_order_pairs_chunk_i_with_its_mirror():
  order = context_parallel.balanced_order(16, 4)  # 8 chunks of 2: shard i holds chunks i and 7 - i
  assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  # Every shard's queries see the same number of causal (query, key) pairs.
  work = [sum(order[4 * s:4 * s + 4] + 1) for s in range(4)]
  assert len(set(work)) == 1


@pytest.mark.parametrize("overrides, message", [
    (("ici_context_parallelism=4", "ici_fsdp_parallelism=2", "max_target_length=36"),
     "max_target_length=36: must be divisible by 2 x context parallelism = 8"),
    (("ici_context_parallelism=3", "ici_fsdp_parallelism=1"),
     "ici_context_parallelism\\*ici_expert_parallelism = 3: must equal the 8 devices"),
    (("compile_topology=v5p-8", "ici_context_parallelism=4", "attention=flash", "max_target_length=1024", _RING),
     "attention='flash': with context parallelism \\(4 shards, context_parallel_strategy=ring, on tpu\\) must be "
     "one of dot_product, chunked"),
    (("compile_topology=v5p-8", "ici_context_parallelism=4", "attention=flash", "max_target_length=512"),
     "max_target_length=512: must be a multiple of 128 x 8 with attention=flash"),
    (("ici_context_parallelism=4", "ici_fsdp_parallelism=2", "attention=chunked", "max_target_length=48",
      "attention_chunk_size=8"), "attention_chunk_size=8: must divide the 12 tokens"),
    (("context_parallel_strategy=ulysses",), "context_parallel_strategy=ulysses: must be one of all_gather, ring"),
    (("ici_sequence_parallelism=4",), "ici_sequence_parallelism: .* use ici_context_parallelism"),
])
def test_bad_context_parallel_settings_are_one_line_config_errors(overrides, message):
  with pytest.raises(errors.ConfigError, match=message):
    tiny_config(*overrides, num_devices=8)


def test_renamed_sequence_key_is_one_line_naming_the_context_key():
  with pytest.raises(errors.ConfigError, match="dcn_context_parallelism") as error:
    run_command("train_compile", "dcn_sequence_parallelism=2")
  assert "\n" not in str(error.value)


def test_collective_bytes_count_what_each_ring_algorithm_sends_at_loop_trip_counts():
  mesh = jax.sharding.AbstractMesh((4, 2), ("c", "t"))
  ring = [(i, (i + 1) % 4) for i in range(4)]

  def body(x):  # one device's block: f32[8] = 32 bytes
    def step(h, _):
      return jax.lax.ppermute(h, "c", ring), None
    y = jax.lax.scan(step, x, None, length=3)[0]
    g = jax.lax.all_gather(y, "c", tiled=True)  # f32[32]
    slices = jnp.zeros(4, jnp.int32)  # a ragged all-to-all, counted by the smaller of its operand and output
    ragged = jax.lax.ragged_all_to_all(y, jnp.zeros(32), slices, slices, slices, slices, axis_name="c")[:8]
    return (jax.lax.psum_scatter(g, "c", tiled=True) + jax.lax.psum(y, ("c", "t"))
            + jax.lax.all_to_all(y, "c", 0, 0, tiled=True) + ragged)

  f = jax.shard_map(body, mesh=mesh, in_specs=P(("c", "t")), out_specs=P(("c", "t")))
  x = jax.ShapeDtypeStruct((64,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P(("c", "t"))))
  jaxpr = jax.make_jaxpr(f)(x).jaxpr
  # Over "c": the ring's 3 ppermutes, the all-gather, the reduce-scatter, the all-to-all, the
  # ragged all-to-all; over both axes, the psum.
  per_device = {"c": 3 * 32 + 3 * 32 + 3 / 4 * 128 + 3 / 4 * 32 + 3 / 4 * 32, "c+t": 2 * 7 / 8 * 32}
  assert costs.collective_bytes(jaxpr) == {axes: 8 * sent for axes, sent in per_device.items()}


@pytest.mark.parametrize("block_size", [10, 14, 17, 70])
def test_key_blocks_merge_to_the_whole_block(block_size):
  """A shard's queries against 70 keys in blocks (10 and 14 divide them; 17 does not and 70 is
  one block, both taken at once) equal the block kernel over all 70 keys, values and logsumexps."""
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (1, 10, 4, 8))
  k, v = (jax.random.normal(key, (1, 70, 2, 8)) for key in keys[1:])
  args = (q, k, v, jnp.arange(60, 70), jnp.arange(70), jnp.ones((1, 10), jnp.int32),
          jnp.repeat(jnp.arange(2), 35)[None], 24)  # queries in the second of two documents, a 24-token window
  kernel = functools.partial(context_parallel.dot_block, scale=0.3, cap=lambda s: s)
  assert_trees_close(context_parallel._over_key_blocks(kernel, block_size)(*args), kernel(*args), rtol=1e-5)


@pytest.mark.parametrize("chunk_size,block_size", [(10, 70), (5, 10), (2, 14), (5, 17)])
def test_block_gradients_equal_autodiff_of_the_block_share(chunk_size, block_size):
  """The ring's backward per block (probabilities from the final logsumexp L, the flash
  backward), over query chunks and key blocks, equals jax.vjp of the block's share of the
  attention, exp(lse_b - L) x its context and exp(lse_b - L), with L held fixed: a soft cap,
  a window and two documents, GQA."""
  keys = jax.random.split(jax.random.key(1), 6)
  q = jax.random.normal(keys[0], (1, 10, 4, 8))
  k, v = (jax.random.normal(key, (1, 70, 2, 8)) for key in keys[1:3])
  index = (jnp.arange(60, 70), jnp.arange(70), jnp.ones((1, 10), jnp.int32), jnp.repeat(jnp.arange(2), 35)[None], 24)
  options = dict(scale=0.3, cap=lambda s: 5.0 * jnp.tanh(s / 5.0))
  _, block_lse = context_parallel.dot_block(q, k, v, *index, **options)
  lse = block_lse + jax.random.uniform(keys[3], block_lse.shape)  # other blocks' keys add to L
  d_out, d_lse = jax.random.normal(keys[4], q.shape), jax.random.normal(keys[5], block_lse.shape)

  def share(q, k, v):
    out, block_lse = context_parallel.dot_block(q, k, v, *index, **options)
    weight = jnp.exp(block_lse - lse)
    return out * weight[..., None], weight

  expected = jax.vjp(share, q, k, v)[1]((d_out, d_lse))
  grads = context_parallel._grads_in_blocks(functools.partial(context_parallel.dot_block_grads, **options),
                                            chunk_size, block_size)
  assert_trees_close(grads(q, k, v, *index, lse, d_out, d_lse), expected, rtol=1e-5)


def test_the_balanced_ring_computes_the_causal_half_and_the_diagonal_blocks():
  """Load-balanced, the ring computes of each step's block only what its queries see: its own
  block's three quarters, and half of every other's. Summed over the C shards its (query, key)
  pairs are T^2 (1/2 + 1/(4C)), where the all-gather (masking, not skipping) computes T^2: the
  traced FLOPs differ by 7 matmuls (2 forward, 5 backward) over the pairs skipped, the rest of
  the step the same."""
  def traced(strategy):
    config = tiny_config("max_target_length=32", "per_device_batch_size=0.25", *_C4F2, "remat_policy=none",
                         f"context_parallel_strategy={strategy}")
    jaxpr = train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)), config).jaxpr
    return costs.matmul_flops(jaxpr), config

  with on_devices(8):
    ring, config = traced("ring")
    all_gather, _ = traced("all_gather")
  length, shards = config.max_target_length, 4
  skipped = length**2 * (1 / 2 - 1 / (4 * shards)) * config.global_batch_size_to_train_on
  per_pair = 7 * 2 * config.base_num_query_heads * config.head_dim * config.base_num_decoder_layers
  assert all_gather - ring == skipped * per_pair
