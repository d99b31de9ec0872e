"""The Llama decoder against independent references."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, model_inputs, tiny_config

from MaxText.layers.attentions import Attention
from MaxText.layers.linears import weights_as
from MaxText.layers.models import Transformer


def init_params(config, seed=0):
  tokens, positions, segments = model_inputs(config)
  variables = Transformer(config).init(jax.random.key(seed), tokens, positions, segments)
  return nn.meta.unbox(variables)["params"]


def reference_attention(x, params, positions, segments, config, chunk=None, nope=False, temperature=None):
  """Plain NumPy: project, rotate (not on a NoPE layer), tune the queries' temperature (scale,
  floor), repeat kv heads, masked softmax (within chunks of the row where given), project back."""
  x = np.asarray(x, np.float64)
  q = np.einsum("btd,dhk->bthk", x, params["query"]["kernel"])
  k = np.einsum("btd,dhk->bthk", x, params["key"]["kernel"])
  v = np.einsum("btd,dhk->bthk", x, params["value"]["kernel"])

  def rope(t):
    half = t.shape[-1] // 2
    freq = config.rope_max_timescale ** (np.arange(half) / half)
    angle = positions[:, :, None, None] / freq
    a, b = t[..., :half], t[..., half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)

  if not nope:
    q, k = rope(q), rope(k)
  if temperature:
    q = q * (np.log(1 + np.floor((positions + 1) / temperature[1])) * temperature[0] + 1)[:, :, None, None]
  group = config.base_num_query_heads // config.base_num_kv_heads
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  length = x.shape[1]
  allowed = np.tril(np.ones((length, length), bool))[None] & (segments[:, :, None] == segments[:, None, :])
  if chunk:
    allowed &= (np.arange(length)[:, None] // chunk == np.arange(length)[None, :] // chunk)[None]
  scores = np.where(allowed[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  context = np.einsum("bhqk,bkhd->bqhd", probs, v)
  return np.einsum("bqhd,hdo->bqo", context, params["out"]["kernel"])


@pytest.mark.parametrize("layer_index, attention", [(0, "chunked"), (1, "dot_product")])
def test_llama4s_chunks_nope_and_temperature_match_numpy(layer_index, attention):
  """Chunks of 5 tokens of the row on the RoPE layers (layer 0), and on the NoPE layer (the last
  of every 2: layer 1) no RoPE, the whole row, and queries scaled by 1 + 0.5 log(1 +
  floor((position + 1) / 2)), against NumPy; packed documents, GQA."""
  config = tiny_config("chunk_attn_window_size=5", "nope_layer_interval=2", "temperature_tuning=true",
                       "temperature_tuning_scale=0.5", "temperature_tuning_floor=2", f"attention={attention}",
                       "attention_chunk_size=4")
  tokens, positions, segments = model_inputs(config)
  x = jax.random.normal(jax.random.key(1), (*tokens.shape, config.base_emb_dim))
  attention = Attention(config)
  params = nn.meta.unbox(attention.init(jax.random.key(0), x, positions, segments, 0))["params"]
  got = attention.apply({"params": params}, x, positions, segments, layer_index)
  nope = layer_index == 1
  want = reference_attention(x, jax.tree.map(np.asarray, params), positions, segments, config,
                             chunk=None if nope else 5, nope=nope, temperature=(0.5, 2) if nope else None)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # And each piece bites: without it the layer's output is another.
  other = reference_attention(x, jax.tree.map(np.asarray, params), positions, segments, config)
  assert np.abs(np.asarray(got) - other).max() > 1e-3


def test_attention_matches_numpy_reference_with_gqa_causal_and_segments():
  config = tiny_config()
  tokens, positions, segments = model_inputs(config)
  x = jax.random.normal(jax.random.key(1), (*tokens.shape, config.base_emb_dim))
  attention = Attention(config)
  params = nn.meta.unbox(attention.init(jax.random.key(0), x, positions, segments, 0))["params"]
  got = attention.apply({"params": params}, x, positions, segments, 0)
  want = reference_attention(x, jax.tree.map(np.asarray, params), positions, segments, config)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_no_information_flows_backwards_or_across_documents():
  config = tiny_config()
  params = init_params(config)
  tokens, positions, segments = model_inputs(config)
  apply = jax.jit(Transformer(config).apply)
  logits = apply({"params": params}, tokens, positions, segments)
  t = 9  # inside the second document (positions 5..15)
  changed_future = tokens.copy()
  changed_future[:, t + 1:] = (changed_future[:, t + 1:] + 1) % config.vocab_size
  after = apply({"params": params}, changed_future, positions, segments)
  np.testing.assert_array_equal(logits[:, :t + 1], after[:, :t + 1])
  changed_first_doc = tokens.copy()
  changed_first_doc[:, :5] = (changed_first_doc[:, :5] + 1) % config.vocab_size
  after = apply({"params": params}, changed_first_doc, positions, segments)
  np.testing.assert_allclose(logits[:, 5:], after[:, 5:], rtol=1e-5, atol=1e-6)
  assert not np.allclose(logits[:, :5], after[:, :5])


def loss_and_grads(config, params, inputs):
  tokens = inputs[0]

  def loss(p):
    logits = Transformer(config).apply({"params": p}, *inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  return jax.jit(jax.value_and_grad(loss))(params)


LAYOUT_SETTINGS = [(), ("remat_layer_interval=2",), ("remat_layer_interval=3", "remat_policy=full"),
                   ("scan_layers=false",), ("scan_layers=false", "remat_layer_interval=2", "remat_policy=minimal"),
                   ("num_vocab_tiling=4",), ("attention=chunked", "attention_chunk_size=4")]


def test_the_parameters_are_one_layout_whatever_the_memory_settings():
  """Stacked [depth, ...] in layer order, names and values set by the shape keys and the seed
  alone: what one setting saves, any other restores."""
  want = init_params(tiny_config("base_num_decoder_layers=4"))
  kernel = want["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
  assert kernel.shape == (4, 32, 64)
  for settings in LAYOUT_SETTINGS:
    got = init_params(tiny_config("base_num_decoder_layers=4", *settings))
    assert jax.tree.structure(got) == jax.tree.structure(want), settings
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), got, want))), settings


@pytest.mark.parametrize("settings", LAYOUT_SETTINGS[1:], ids=" ".join)
def test_every_stack_gives_the_same_loss_and_gradients_from_the_same_parameters(settings):
  """Against a Python loop over the layers, one layer at a time: the scan over blocks of
  remat_layer_interval layers (with a leftover block at 4 % 3) and the looped stack."""
  reference = tiny_config("base_num_decoder_layers=4", "scan_layers=false")
  config = tiny_config("base_num_decoder_layers=4", *settings)
  params, inputs = init_params(reference), model_inputs(reference)
  want_loss, want_grads = loss_and_grads(reference, params, inputs)
  loss, grads = loss_and_grads(config, params, inputs)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_trees_close(grads, want_grads, rtol=1e-5)


GEMMA2 = ("decoder_block=gemma2", "base_num_decoder_layers=7", "sliding_window_size=5", "query_pre_attn_scalar=24",
          "attn_logits_soft_cap=2", "final_logits_soft_cap=3", "logits_via_embedding=true")
# Gemma 3's five local layers to one global: layer 5 is global, layer 6 local again; the local
# layers have their own RoPE base and the global ones slowed positions.
GEMMA3 = ("decoder_block=gemma3", "base_num_decoder_layers=7", "sliding_window_size=5", "query_pre_attn_scalar=24",
          "local_rope_max_timescale=100", "rope_linear_scaling_factor=8", "logits_via_embedding=true")


# Llama 4's attention: chunks of 5 on every layer but the NoPE ones (the last of every 4: layer 3),
# whose queries are tuned by their positions.
LLAMA4_ATTENTION = ("base_num_decoder_layers=7", "chunk_attn_window_size=5", "nope_layer_interval=4",
                    "temperature_tuning=true", "temperature_tuning_floor=3")


@pytest.mark.parametrize("family, settings", [
    *[(family, settings) for family in (GEMMA2, GEMMA3)
      for settings in [("remat_policy=minimal",), ("attention=chunked", "attention_chunk_size=4")]],
    # Blocks of layers: a layer's kind is its model index's, which Gemma 2's parity would take as
    # Gemma 3's period of six does.
    (GEMMA3, ("remat_layer_interval=3", "remat_policy=full")),
    # The chunks' query chunks are test_llama4s_chunks_nope_and_temperature_match_numpy's.
    (LLAMA4_ATTENTION, ("remat_layer_interval=3", "remat_policy=full"))],
    ids=lambda v: " ".join(v) if len(v) < 5 else {GEMMA2: "gemma2", GEMMA3: "gemma3"}.get(v, "llama4 attention"))
def test_gemma_gives_the_same_loss_and_gradients_under_every_memory_setting(settings, family):
  """The local layers (sliding, or chunked and with RoPE) are picked by a traced index inside the
  scan: in blocks of 3 of 7 layers the second block starts at layer 3 (local in Gemma 3, NoPE in
  Llama 4), Gemma 3's global layer 5 is the last of the second block,
  and layer 6 is left over. Remat, and the soft cap, window and chunks inside query chunks,
  against the Python loop."""
  reference = tiny_config(*family, "scan_layers=false")
  config = tiny_config(*family, *settings)
  params, inputs = init_params(reference), model_inputs(reference)
  want_loss, want_grads = loss_and_grads(reference, params, inputs)
  loss, grads = loss_and_grads(config, params, inputs)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_trees_close(grads, want_grads, rtol=1e-5)


def test_tied_embeddings_use_the_table_as_output_head():
  config = tiny_config("logits_via_embedding=true")
  params = init_params(config)
  assert "logits_kernel" not in params
  tokens, positions, segments = model_inputs(config)
  model = Transformer(config)
  hidden, kernel, _ = model.apply({"params": params}, tokens, positions, segments, return_hidden=True)
  np.testing.assert_array_equal(kernel, params["token_embedder"]["embedding"].T)
  logits = model.apply({"params": params}, tokens, positions, segments)
  np.testing.assert_allclose(logits, hidden @ kernel, rtol=1e-5, atol=1e-5)


def test_bfloat16_activations_keep_float32_parameters():
  config = tiny_config("dtype=bfloat16", "weight_dtype=float32")
  params = init_params(config)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  tokens, positions, segments = model_inputs(config)
  hidden, kernel, _ = Transformer(config).apply({"params": params}, tokens, positions, segments,
                                                return_hidden=True)
  assert hidden.dtype == jnp.bfloat16 and kernel.dtype == jnp.bfloat16
  logits = Transformer(config).apply({"params": params}, tokens, positions, segments)
  assert logits.dtype == jnp.float32


def test_the_layers_cast_of_their_float32_weights_is_bfloat16s_own_rounding():
  """linears.weights_as computes float32 -> bfloat16 itself; NumPy's bfloat16 (ml_dtypes) is
  the reference: every exponent, subnormals, ties both ways, the largest finite values
  (rounding to infinity), infinities and zeros bit for bit, NaN as NaN; the gradient is the
  cotangent cast back, as astype's."""
  rng = np.random.default_rng(0)
  bits = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
  ties = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exactly halfway: to the even neighbour
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                      np.finfo(np.float32).tiny, 1e-45, np.nan], np.float32)
  x = np.concatenate([bits.view(np.float32), ties.view(np.float32), special])
  got = np.asarray(jax.jit(lambda v: weights_as(v, jnp.bfloat16))(x))
  assert got.dtype == ml_dtypes.bfloat16
  with np.errstate(over="ignore", invalid="ignore"):
    want = x.astype(ml_dtypes.bfloat16)
  nan = np.isnan(x)
  np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
  assert np.isnan(got[nan].astype(np.float32)).all()

  w = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((8, 16)), jnp.bfloat16)
  grad = lambda cast: jax.grad(lambda w: jnp.sum(cast(w) * c).astype(jnp.float32))(w)
  ours, theirs = grad(lambda w: weights_as(w, jnp.bfloat16)), grad(lambda w: w.astype(jnp.bfloat16))
  assert ours.dtype == jnp.float32
  np.testing.assert_array_equal(ours, theirs)
  np.testing.assert_array_equal(weights_as(w, jnp.float32), w)


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 512])  # 512: longer than the 16-token rows, so the row
def test_chunked_attention_is_exact(chunk_size):
  full = tiny_config()
  chunked = tiny_config("attention=chunked", f"attention_chunk_size={chunk_size}")
  params = init_params(full)
  inputs = model_inputs(full)
  want_loss, want_grads = loss_and_grads(full, params, inputs)
  loss, grads = loss_and_grads(chunked, params, inputs)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_trees_close(grads, want_grads, rtol=1e-5)


@pytest.mark.parametrize("kernel, length, under_mesh, gemma2, fused",
                         [("splash", 256, False, False, False), ("splash", 1024, True, False, False),
                          ("splash", 1024, False, True, False), ("splash", 2048, False, False, True),
                          ("triton", 256, False, False, False), ("triton", 256, True, False, False)])
def test_flash_attention_is_exact_in_the_pallas_interpreter(kernel, length, under_mesh, gemma2, fused):
  """Each Pallas kernel (TPU's splash, GPU's Triton) run by Pallas's interpreter, against dot_product attention:
  values and gradients, float32, GQA, three packed documents whose boundaries fall inside
  kernel blocks; on TPU at 1024 tokens two 512-blocks, the upper one skipped by the causal
  mask (the GPU kernel's blocks are 128 forward, 128 x 64 and 64 x 128 backward). With Gemma 2's options the
  TPU kernel also takes a query scale, a soft cap and a 600-token window (chosen by a traced
  flag, as in a scan), whose lower-left block is skipped too. Splash's fused backward (one kernel
  for dq, dk and dv) at 2048 tokens in key blocks of 1024, each of two 512-key steps: the partial
  dq's of the two key blocks summed."""
  from MaxText import sharding
  from MaxText.layers.attentions import dot_product_attention, flash_attention
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, heads, 32)), jnp.float32) for heads in (4, 2, 2))
  doc = np.searchsorted([length * 3 // 8 + 5, length * 3 // 4 - 7], np.arange(length), side="right") + 1
  segments = jnp.asarray(np.stack([doc, np.ones(length, int)]), jnp.int32)

  options = dict(scale=0.1, soft_cap=2.0, window=600) if gemma2 else {}

  def loss_and_grads(attend):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segments, **options), q, k, v)
    return out, vjp(jnp.cos(out))  # the gradients of sum(sin(out))

  def flash(*args, **kwargs):
    return flash_attention(*args, kernel_name=kernel, sliding=jnp.asarray(True), interpret=True, **kwargs,
                           options=dict(fused_backward=True, dkv_block=1024) if fused else None)

  want = loss_and_grads(dot_product_attention)
  if under_mesh:  # through shard_map over a mesh and the logical rules, as in the model
    config = tiny_config()
    with sharding.activate(sharding.create_mesh(config), config):
      got = loss_and_grads(flash)
  else:
    got = loss_and_grads(flash)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  assert_trees_close(got[1], want[1], rtol=1e-5)
  if fused:  # and the kernels the cost model counts: 2 products forward, 5 in the one backward kernel
    from MaxText import costs
    forward = 512 * 512 * (1 + 2 + 3 + 4)  # causal (query, key) pairs of 4 query blocks, 512-key blocks
    backward = 512 * (1024 + 1024 + 2048 + 2048)  # ... and 1024-key blocks
    assert costs.kernel_flops(jax.make_jaxpr(lambda: loss_and_grads(flash))().jaxpr) == (
        2 * 2 * 4 * 32 * (2 * forward + 5 * backward))


def test_splash_takes_attention_chunks_in_the_pallas_interpreter():
  """Llama 4's chunks in TPU's splash kernel (Pallas's interpreter), 1024 tokens in two 512-blocks,
  chunks of 300 whose boundaries fall inside both and empty the second block's lower-left part,
  three packed documents: values and gradients equal dot_product attention's with the same chunks."""
  from MaxText.layers.attentions import dot_product_attention, flash_attention
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 1024, heads, 32)), jnp.float32) for heads in (4, 2, 2))
  segments = jnp.asarray(np.searchsorted([389, 761], np.arange(1024), side="right")[None] + 1, jnp.int32)

  def loss_and_grads(attend):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segments, chunk_window=300), q, k, v)
    return out, vjp(jnp.cos(out))

  want = loss_and_grads(dot_product_attention)
  got = loss_and_grads(lambda *args, **kwargs: flash_attention(*args, kernel_name="splash", sliding=jnp.asarray(True),
                                                               interpret=True, **kwargs))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  assert_trees_close(got[1], want[1], rtol=1e-5)


def test_cudnn_document_offsets_give_the_segment_mask():
  """cuDNN takes packed documents as per-row lengths and starts: the causal mask those imply
  (token t in document j when starts[j] <= t < starts[j] + lengths[j]) is the segment-id mask
  of the other kernels, for rows of several documents, one, and trailing padding (id 0), up to
  exactly max_segments runs; a host batch with a row of more stops with the key named."""
  import types

  from MaxText import errors
  from MaxText.layers.attentions import attention_mask, check_documents, document_offsets, documents_per_row
  length, max_segments = 24, 5
  rows = np.array([[1] * 5 + [2] * 9 + [3] * 3 + [4] * 2 + [5] * 5,
                   [1] * length,
                   [1] * 7 + [2] * 11 + [0] * 6,
                   [1] * 23 + [2]], np.int32)
  lengths, starts = (np.asarray(x) for x in document_offsets(jnp.asarray(rows), max_segments))
  assert lengths.shape == (4, max_segments) and starts.shape == (4, max_segments + 1)
  document = np.full(rows.shape, -1)
  for b in range(len(rows)):
    for j in range(max_segments):
      if lengths[b, j] >= 0:
        assert document[b, starts[b, j]:starts[b, j] + lengths[b, j]].max() == -1  # runs do not overlap
        document[b, starts[b, j]:starts[b, j] + lengths[b, j]] = j
      else:
        assert starts[b, j] == -1
  assert (document >= 0).all() and (starts[:, -1] == -1).all()
  causal = np.tril(np.ones((length, length), bool))
  implied = (document[:, :, None] == document[:, None, :]) & causal
  np.testing.assert_array_equal(implied, np.asarray(attention_mask(jnp.arange(length), jnp.asarray(rows)))[:, 0])
  np.testing.assert_array_equal(documents_per_row(rows), (lengths >= 0).sum(1))

  cfg = types.SimpleNamespace(attention="flash", flash_kernel="cudnn", max_segments_per_seq=max_segments)
  check_documents(cfg, rows)
  too_many = rows.copy()
  too_many[0, -1] = 6
  with pytest.raises(errors.ConfigError, match="max_segments_per_seq=5: a batch has a row of 6 documents"):
    check_documents(cfg, too_many)
  check_documents(types.SimpleNamespace(**{**vars(cfg), "flash_kernel": "triton"}), too_many)


def test_cudnn_attention_flops_are_counted(monkeypatch):
  """cuDNN's attention is a primitive of its own, invisible to a count of dot_generals: the traced
  FLOPs of its forward and backward (traced here with cuDNN's device checks stubbed, as nothing
  runs) are the hand count, 2 + 5 matmuls over the row's causal half of (query, key) pairs."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  from MaxText import costs
  from MaxText.layers.attentions import flash_attention
  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91900)
  monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
  rows, length, heads, kv_heads, width = 2, 256, 4, 2, 64
  q = jnp.zeros((rows, length, heads, width), jnp.bfloat16)
  kv = jnp.zeros((rows, length, kv_heads, width), jnp.bfloat16)
  segments = jnp.ones((rows, length), jnp.int32)

  def loss(q, k, v):
    return flash_attention(q, k, v, segments, "cudnn", max_segments=4).astype(jnp.float32).sum()

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
  want = (2 + 5) * 2 * rows * heads * width * length * (length + 1) / 2
  assert costs.matmul_flops(jaxpr) == want
  assert costs.kernel_flops(jaxpr) == want
