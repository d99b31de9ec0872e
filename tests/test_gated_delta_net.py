"""Gated DeltaNet (layers/gated_delta_net.py): the chunked rule against the rule applied token by
token, packed documents resetting the state and the convolution's window; a small qwen3_next
model (a Gated DeltaNet layer and an attention layer) on 8 devices gives one device's loss and
gradients under fsdp x tensor and under context parallelism, load-balanced and contiguous;
memory linear in the length; settings it cannot run refused in one line. Its logits against
transformers' Qwen3-Next: tests/test_hf_checkpoint.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  SHARDED,
  assert_trees_close,
  loss_gradients,
  on_devices,
  tiny_config,
  trainer_and_state,
  with_slow_decays,
)

from MaxText import costs, errors, sharding, train_step
from MaxText.layers import gated_delta_net

QWEN3_NEXT = ("decoder_block=qwen3_next", "base_num_decoder_layers=2", "inhomogeneous_layer_cycle_interval=2",
              "head_dim=8", "partial_rotary_factor=0.25", "gdn_num_key_heads=4", "gdn_num_value_heads=8",
              "gdn_key_head_dim=8", "gdn_value_head_dim=8", "gdn_chunk_size=4", "num_experts=4",
              "num_experts_per_tok=2", "base_moe_mlp_dim=32", "shared_experts=1", "max_target_length=32")


def _silu(x):
  return x / (1 + np.exp(-x))


def rule_token_by_token(q, k, v, b, a, convs, a_log, dt_bias, segments):
  """Qwen3-Next's linear attention as its definition reads, in float64, one token at a time: the
  causal convolution over each document's tokens so far, SiLU, L2 norms, and the state updated by
  the gated delta rule, reset where a document starts."""
  batch, length, key_heads, dk = q.shape
  value_heads, dv = v.shape[2:]
  groups, width = value_heads // key_heads, convs[0].shape[0]
  out = np.zeros((batch, length, value_heads, dv))
  for row in range(batch):
    state = np.zeros((value_heads, dk, dv))
    for t in range(length):
      if t == 0 or segments[row, t] != segments[row, t - 1]:
        state[:] = 0
      window = [s for s in range(max(0, t - width + 1), t + 1) if segments[row, s] == segments[row, t]]
      mixed = [_silu(sum(w[width - 1 - (t - s)] * x[row, s] for s in window)) for x, w in zip((q, k, v), convs)]
      query, key = (m / np.sqrt(np.sum(m * m, axis=-1, keepdims=True) + 1e-6) for m in mixed[:2])
      for h in range(value_heads):
        beta = 1 / (1 + np.exp(-b[row, t, h]))
        decay = np.exp(-np.exp(a_log[h]) * np.log1p(np.exp(a[row, t, h] + dt_bias[h])))
        kk, qq = key[h // groups], query[h // groups] * dk**-0.5
        state[h] *= decay
        state[h] += np.outer(kk, beta * (mixed[2][h] - state[h].T @ kk))
        out[row, t, h] = state[h].T @ qq
  return out


@pytest.mark.parametrize("chunk", [4, 5])
def test_the_chunked_rule_is_the_rule_token_by_token(chunk):
  """Chunks of 4 tokens (the row whole chunks) and of 5 (the last padded), three packed documents
  in a row, one starting inside a chunk and one at the start of a chunk, two value heads per
  key head, decays slow enough that the state carries from chunk to chunk."""
  rng = np.random.default_rng(0)
  batch, length, key_heads, value_heads, dk, dv, width = 2, 24, 2, 4, 4, 3, 4
  inputs = [rng.normal(size=(batch, length, key_heads, dk)), rng.normal(size=(batch, length, key_heads, dk)),
            rng.normal(size=(batch, length, value_heads, dv)), rng.normal(size=(batch, length, value_heads)),
            rng.normal(size=(batch, length, value_heads))]
  convs = (rng.normal(size=(width, key_heads, dk)), rng.normal(size=(width, key_heads, dk)),
           rng.normal(size=(width, value_heads, dv)))
  a_log, dt_bias = np.log(rng.uniform(0.05, 0.5, value_heads)), rng.normal(size=value_heads)
  segments = np.array([[1] * 7 + [2] * 9 + [3] * 8, [5] * 24])
  want = rule_token_by_token(*inputs, convs, a_log, dt_bias, segments)

  class Config:
    gdn_chunk_size = chunk

  as32 = lambda x: jnp.asarray(x, jnp.float32)
  got = gated_delta_net.local_rule(Config, *map(as32, inputs), tuple(map(as32, convs)), as32(a_log), as32(dt_bias),
                                   jnp.asarray(segments))
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def one_device():
  """One device's loss and gradients of the small model, at parameters whose decays are drawn
  slow (conftest.with_slow_decays), so the state each context shard hands on carries into the
  next; the batch's rows hold two documents."""
  config = tiny_config(*SHARDED, *QWEN3_NEXT, "per_device_batch_size=8")
  params = with_slow_decays(jax.device_get(trainer_and_state(config)[1].params))
  return params, loss_gradients(config, params=params)


# Context 4 with load balancing: 8 runs of 4 tokens, a document starting inside the third; without,
# 4 runs of 8 beside tensor-sharded heads.
MESHES = {"fsdp4_tensor2": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
          "context4_fsdp2": ("ici_context_parallelism=4", "ici_fsdp_parallelism=2"),
          "context4_tensor2_contiguous": ("ici_context_parallelism=4", "ici_tensor_parallelism=2",
                                          "context_parallel_load_balance=false")}


@pytest.mark.parametrize("mesh", MESHES)
def test_qwen3_next_on_8_devices_gives_one_devices_loss_and_gradients(one_device, mesh):
  params, want = one_device
  with on_devices(8):
    got = loss_gradients(tiny_config(*SHARDED, *QWEN3_NEXT, "per_device_batch_size=1", *MESHES[mesh]), params=params)
  assert_trees_close(got, want, rtol=1e-5, what=mesh)


def _temp_bytes(length: int) -> int:
  config = tiny_config("decoder_block=qwen3_next", "base_num_decoder_layers=2", "inhomogeneous_layer_cycle_interval=2",
                       "base_emb_dim=32", "head_dim=8", "gdn_num_key_heads=2", "gdn_num_value_heads=4",
                       "gdn_key_head_dim=8", "gdn_value_head_dim=8", "num_experts=2", "num_experts_per_tok=1",
                       "base_moe_mlp_dim=32", "shared_experts=1", "attention=chunked", "attention_chunk_size=1024",
                       "per_device_batch_size=1", f"max_target_length={length}", "remat_policy=full")
  compiled = train_step.compile_train_step(train_step.build(config, sharding.create_mesh(config)), config)
  return compiled.memory_analysis().temp_size_in_bytes


def test_a_step_of_a_linear_layer_and_a_chunked_attention_layer_takes_memory_linear_in_length():
  """XLA:CPU's temp memory of the compiled step at 16,384 tokens is at most 2.2 times that at 8,192."""
  assert _temp_bytes(16384) <= 2.2 * _temp_bytes(8192)


@pytest.mark.parametrize("overrides, message", [
    (("gdn_num_value_heads=6",), "gdn_num_value_heads=6: must be a multiple of gdn_num_key_heads=4"),
    (("ici_tensor_parallelism=4", "gdn_num_key_heads=2"), "gdn_num_key_heads=2: must be divisible by the 4 shards"),
    (("base_num_decoder_layers=3",), "inhomogeneous_layer_cycle_interval=2: must divide base_num_decoder_layers=3"),
    (("ici_context_parallelism=8", "gdn_conv_kernel_dim=4"), "gdn_conv_kernel_dim=4: must be at most one more than "
                                                             "the 2 consecutive tokens"),
])
def test_settings_gated_deltanet_cannot_run_are_one_line_naming_the_key(overrides, message):
  with on_devices(8), pytest.raises(errors.ConfigError, match=message):
    tiny_config(*SHARDED, *QWEN3_NEXT, *overrides)


def test_model_flops_are_the_traced_products_but_attentions_masked_half_and_the_solves():
  """Without remat the traced step runs each product once forward and twice backward: the Gated
  DeltaNet layer's as costs counts them (gated_delta_net.gdn_macs), and the attention layer's whole
  T x T scores and context, of which the model counts the causal half. The rule's triangular
  solves, which the model counts as C (dk + dv) / 2 multiply-adds a token and value head forward
  and twice that backward, run as solves, not products, but for one product backward (the
  system's gradient), twice the forward solves' multiply-adds."""
  config = tiny_config(*SHARDED, *QWEN3_NEXT, "remat_policy=none", "per_device_batch_size=1", num_devices=1)
  jaxpr = train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)), config).jaxpr
  b, t = config.global_batch_size_to_train_on, config.max_target_length
  masked_half = 2 * b * t * t * config.base_num_query_heads * 2 * config.head_dim / 2  # one attention layer
  solves = 2 * b * t * config.gdn_num_value_heads * config.gdn_chunk_size * (
      config.gdn_key_head_dim + config.gdn_value_head_dim) / 2  # one linear layer's, forward
  assert costs.matmul_flops(jaxpr) == pytest.approx(
      costs.training_flops_per_step(config) + 3 * masked_half - 3 * solves + 2 * solves, rel=1e-12)
