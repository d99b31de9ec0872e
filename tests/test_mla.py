"""DeepSeek's multi-head latent attention (attention_type=mla) and YaRN RoPE against independent
references: a plain multi-head attention from the layer's own weights up-projected, RoPE in
DeepSeek's interleaved layout, Hugging Face's YaRN formulas; one device against 8."""

import functools
import math

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import assert_mesh_gradients_equal_one_device, assert_trees_close, model_inputs, tiny_config

from MaxText import costs, errors, sharding, train_step
from MaxText.checkpoint_conversion import mapping
from MaxText.layers.attentions import Attention, dot_product_attention, flash_attention, mla_scale
from MaxText.layers.embeddings import rope_attention_factor, rope_timescales

# TINY's 4 heads: per head 6 features without RoPE and 4 with, values 5 wide (neither the
# query/key width 10 nor head_dim 8), keys and values from 16 latent features.
MLA = ("attention_type=mla", "base_num_kv_heads=4", "kv_lora_rank=16", "qk_nope_head_dim=6", "qk_rope_head_dim=4",
       "v_head_dim=5")
YARN = ("rope_type=yarn", "rope_max_timescale=100", "rope_scaling_factor=4", "rope_original_max_position=8",
        "beta_fast=4", "beta_slow=0.5", "mscale=0.8", "mscale_all_dim=0.6")


def hf_yarn(dim, base, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim):
  """Hugging Face's _compute_yarn_parameters, in float64: (inv_freq [dim / 2], attention_factor),
  and DeepSeek-V3's softmax scale factor mscale(factor, mscale_all_dim)^2."""
  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                      else get_mscale(factor))

  def correction_dim(rotations):
    return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

  low = max(math.floor(correction_dim(beta_fast)), 0)
  high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
  pos_freqs = base ** (np.arange(0, dim, 2) / dim)
  extrapolation = 1 - ramp
  inv_freq = 1 / (factor * pos_freqs) * (1 - extrapolation) + 1 / pos_freqs * extrapolation
  softmax = get_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
  return inv_freq, attention_factor, softmax


def reference_mla(x, p, positions, segments, cfg):
  """DeepSeek-V3's attention (transformers' DeepseekV3Attention) in float64 NumPy: the latent
  keys and values up-projected to every head, the one RoPE key broadcast to all of them, RoPE
  on interleaved pairs (2i, 2i + 1) of features stored in that order (the layer's half-split
  pairs (i, i + d/2) permuted as an importer would), a masked softmax over each document's past."""
  x = np.asarray(x, np.float64)
  nope, rope, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank

  def rms(t, scale):
    return t / np.sqrt(np.mean(t**2, -1, keepdims=True) + cfg.normalization_layer_epsilon) * scale

  if cfg.q_lora_rank:
    q = np.einsum("btr,rnh->btnh", rms(x @ p["wq_a"]["kernel"], p["q_norm"]["scale"]), p["wq_b"]["kernel"])
  else:
    q = np.einsum("btd,dnh->btnh", x, p["query"]["kernel"])
  kv_a = x @ p["wkv_a"]["kernel"]
  kv = np.einsum("btr,rnh->btnh", rms(kv_a[..., :rank], p["kv_norm"]["scale"]), p["wkv_b"]["kernel"])
  k_nope, v = kv[..., :nope], kv[..., nope:]
  # The layer's pair (i, i + d/2) is the checkpoint's (2i, 2i + 1).
  interleaved = np.argsort(np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)]))
  q_pe, k_pe = q[..., nope:][..., interleaved], kv_a[:, :, None, rank:][..., interleaved]
  if cfg.rope_type == "yarn":
    inv_freq, factor, softmax = hf_yarn(rope, cfg.rope_max_timescale, cfg.rope_scaling_factor,
                                        cfg.rope_original_max_position, cfg.beta_fast, cfg.beta_slow, cfg.mscale,
                                        cfg.mscale_all_dim)
  else:
    inv_freq, factor, softmax = cfg.rope_max_timescale ** -(np.arange(0, rope, 2) / rope), 1.0, 1.0
  angle = positions[:, :, None, None] * inv_freq

  def rotate(t):
    even, odd = t[..., 0::2], t[..., 1::2]
    pairs = np.stack([even * np.cos(angle) - odd * np.sin(angle), odd * np.cos(angle) + even * np.sin(angle)], -1)
    return factor * pairs.reshape(t.shape)

  q = np.concatenate([q[..., :nope], rotate(q_pe)], -1)
  k = np.concatenate([k_nope, np.broadcast_to(rotate(k_pe), (*k_nope.shape[:3], rope))], -1)
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) * (nope + rope) ** -0.5 * softmax
  length = x.shape[1]
  allowed = np.tril(np.ones((length, length), bool))[None] & (segments[:, :, None] == segments[:, None, :])
  scores = np.where(allowed[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bqhd,hdo->bqo", np.einsum("bhqk,bkhd->bqhd", probs, v), p["out"]["kernel"])


@pytest.mark.parametrize("overrides", [("q_lora_rank=0",),
                                       ("q_lora_rank=12", *YARN, "attention=chunked", "attention_chunk_size=4")])
def test_mla_matches_the_up_projected_multi_head_reference(overrides):
  """Queries direct (DeepSeek-V2-Lite) with dot_product attention; through q_lora_rank latent
  features with YaRN (its RoPE factor and DeepSeek's softmax temperature) and chunked attention."""
  config = tiny_config(*MLA, *overrides)
  tokens, positions, segments = model_inputs(config)
  x = jax.random.normal(jax.random.key(1), (*tokens.shape, config.base_emb_dim))
  attention = Attention(config)
  params = nn.meta.unbox(attention.init(jax.random.key(0), x, positions, segments, 0))["params"]
  assert ("wq_a" in params) == bool(config.q_lora_rank)
  got = attention.apply({"params": params}, x, positions, segments, 0)
  want = reference_mla(x, jax.tree.map(np.asarray, params), positions, segments, config)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 1.0), (0.0, 0.0), (0.707, 1.2)])
def test_yarn_frequencies_and_temperatures_match_hugging_face(mscale, mscale_all_dim):
  """DeepSeek-V3's YaRN (factor 40 over 4096 tokens, 64 RoPE features, base 10000): the rotation
  frequencies, RoPE's attention factor and MLA's softmax scale, against transformers' formulas."""
  config = tiny_config(*MLA, "rope_type=yarn", "rope_max_timescale=10000", "rope_scaling_factor=40",
                       "rope_original_max_position=4096", "beta_fast=32", "beta_slow=1", f"mscale={mscale}",
                       f"mscale_all_dim={mscale_all_dim}", "qk_nope_head_dim=128", "qk_rope_head_dim=64")
  inv_freq, factor, softmax = hf_yarn(64, 10000, 40, 4096, 32, 1, mscale, mscale_all_dim)
  assert 0 < np.sum((inv_freq < 10000 ** -(np.arange(32) / 32)) & (inv_freq > 10000 ** -(np.arange(32) / 32) / 40))
  np.testing.assert_allclose(1 / np.asarray(rope_timescales(config, 64), np.float64), inv_freq, rtol=1e-5)
  np.testing.assert_allclose(rope_attention_factor(config), factor, rtol=1e-12)
  np.testing.assert_allclose(mla_scale(config), 192**-0.5 * softmax, rtol=1e-12)


def test_flash_kernel_takes_values_of_their_own_width():
  """The TPU kernel in Pallas's interpreter, queries and keys 32 wide, values 16 (padded for the
  kernel, cut from its context): values and gradients as dot_product attention's, float32."""
  rng = np.random.default_rng(0)
  q, k, v = (jax.numpy.asarray(rng.normal(size=(2, 128, 2, width)), np.float32) for width in (32, 32, 16))
  segments = jax.numpy.asarray(np.stack([np.repeat([1, 2], [50, 78]), np.ones(128, int)]), np.int32)

  def values_and_grads(attend):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segments, scale=0.2), q, k, v)
    return out, vjp(jax.numpy.cos(out))

  got = values_and_grads(functools.partial(flash_attention, kernel_name="splash", interpret=True))
  want = values_and_grads(dot_product_attention)
  assert got[0].shape == (2, 128, 2, 16)
  assert_trees_close(got, want, rtol=1e-5)


MLA_SHARDED = ("attention_type=mla", "base_num_kv_heads=8", "q_lora_rank=12", "kv_lora_rank=16", "qk_nope_head_dim=6",
               "qk_rope_head_dim=4", "v_head_dim=5")


@pytest.mark.slow
def test_mla_under_sharded_meshes_gives_one_devices_loss_and_gradients():
  """8 simulated devices: fsdp x tensor x data, and context parallelism (its ring, over the
  values' own width) with fsdp and tensor."""
  assert_mesh_gradients_equal_one_device(
      {"fsdp2_tensor2_data2": ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_data_parallelism=2"),
       "context2_fsdp2_tensor2_ring": ("ici_context_parallelism=2", "ici_fsdp_parallelism=2",
                                       "ici_tensor_parallelism=2", "context_parallel_strategy=ring")},
      model=MLA_SHARDED)


def test_model_flops_are_the_traced_products_but_the_masked_half():
  """Without remat the traced step runs each product once forward and twice backward, and the
  whole T x T scores (queries and keys 10 wide) and context (values 5 wide): the model count plus
  the half the causal mask removes."""
  config = tiny_config(*MLA, "q_lora_rank=12", "remat_policy=none")
  jaxpr = train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)), config).jaxpr
  b, t, layers = config.global_batch_size_to_train_on, config.max_target_length, config.base_num_decoder_layers
  masked_half = 2 * b * t * t * config.base_num_query_heads * (10 + 5) * layers / 2
  assert costs.matmul_flops(jaxpr) == pytest.approx(costs.training_flops_per_step(config) + 3 * masked_half,
                                                     rel=1e-12)


def test_kimi_k2s_yarn_with_equal_betas_matches_hugging_face():
  """Kimi K2's YaRN (factor 32 over 4096 tokens, base 50000, beta_fast = beta_slow = 1): one ramp
  from kept to slowed frequencies, as transformers forms it."""
  config = tiny_config(*MLA, "rope_type=yarn", "rope_max_timescale=50000", "rope_scaling_factor=32",
                       "rope_original_max_position=4096", "beta_fast=1", "beta_slow=1", "mscale=1", "mscale_all_dim=1",
                       "qk_nope_head_dim=128", "qk_rope_head_dim=64")
  inv_freq, factor, softmax = hf_yarn(64, 50000, 32, 4096, 1, 1, 1, 1)
  np.testing.assert_allclose(1 / np.asarray(rope_timescales(config, 64), np.float64), inv_freq, rtol=1e-5)
  np.testing.assert_allclose(rope_attention_factor(config), factor, rtol=1e-12)
  np.testing.assert_allclose(mla_scale(config), 192**-0.5 * softmax, rtol=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (("kv_lora_rank=0",), "kv_lora_rank=0: must be >= 1"),
    (("qk_rope_head_dim=3",), "qk_rope_head_dim=3: must be even"),
    (("base_num_kv_heads=2",), "base_num_kv_heads=2: must equal base_num_query_heads=4"),
    (("attention_head_chunks=2",), "attention_head_chunks=2: must be 1 for attention_type=mla"),
    (("rope_type=yarn", "beta_slow=40"), "beta_fast=32.0: must be >= beta_slow=40.0"),
])
def test_bad_mla_and_yarn_settings_are_one_line_config_errors(overrides, message):
  with pytest.raises(errors.ConfigError) as e:
    tiny_config(*MLA, *overrides)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_yarn_model_exports_its_rope_and_reads_back_as_the_same_model():
  """transformers takes YaRN for any family (rope_parameters): the exported config.json of a
  Llama with YaRN gives back every model key, YaRN's included. (Latent attention exports only as
  DeepSeek's class: tests/test_hf_checkpoint.py.)"""
  config = tiny_config(*YARN)
  mapping.check_exportable(config)
  written = mapping.hf_config(config, "float32")
  assert written["rope_parameters"]["rope_type"] == "yarn"
  mapping.check_shape(config, written, "exported")
