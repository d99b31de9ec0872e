"""attention=flash under context parallelism: each context shard's splash kernel, run by
Pallas's interpreter, gives one device's dot_product attention and its gradients."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, on_devices, tiny_config

from MaxText import sharding
from MaxText.layers import context_parallel
from MaxText.layers.attentions import dot_product_attention


def packed_segments(length):
  """Row 0: three documents, their boundaries inside shards and blocks; row 1: one."""
  doc = np.searchsorted([length * 3 // 8 + 5, length * 3 // 4 - 7], np.arange(length), side="right") + 1
  return jnp.asarray(np.stack([doc, np.ones(length, int)]), jnp.int32)


@pytest.mark.parametrize("context, length, balanced, gemma2, fused", [
    (4, 1024, True, False, False), (4, 1024, False, False, False), (2, 512, True, True, False),
    (4, 1024, True, False, True)])
def test_flash_per_context_shard_equals_one_device(context, length, balanced, gemma2, fused):
  """The attention alone, its values and the gradients of q, k and v, on context 4 x fsdp 2
  (balanced and contiguous) and context 2 x fsdp 2 x tensor 2 with Gemma 2's options (a query
  scale, a soft cap and a 300-token window, its lower-left blocks skipped too) and values
  narrower than the queries and keys (MLA's); and balanced with splash's fused backward, in
  key blocks of the whole row."""
  rng = np.random.default_rng(0)
  widths = (32, 32, 16 if gemma2 else 32)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, heads, width)), jnp.float32)
             for heads, width in zip((4, 2, 2), widths))
  segments = packed_segments(length)
  options = dict(scale=0.1, soft_cap=2.0, window=300) if gemma2 else dict(scale=0.2, soft_cap=0.0, window=None)
  family = ("sliding_window_size=300", "attn_logits_soft_cap=2.0") if gemma2 else ()
  with on_devices(8):
    config = tiny_config(f"ici_context_parallelism={context}", "ici_fsdp_parallelism=2",
                         f"ici_tensor_parallelism={4 // context}",
                         f"max_target_length={length}", f"context_parallel_load_balance={balanced}", *family)
  order = context_parallel.balanced_order(length, context) if balanced else np.arange(length)
  flash = types.SimpleNamespace(**{**config.to_dict(), "attention": "flash", "platform": "tpu",
                                   "sa_use_fused_bwd_kernel": fused, "sa_block_kv_dkv": length if fused else None})

  def sharded(q, k, v):  # in the order the model holds them in: load_balance's
    q, k, v, stored = (jnp.take(x, order, axis=1) for x in (q, k, v, segments))
    out = context_parallel.attention(q, k, v, stored, flash, options["scale"], None, options["window"],
                                     interpret=True)
    return jnp.take(out, np.argsort(order), axis=1)

  def loss_and_grads(attend):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(jnp.cos(out))  # the gradients of sum(sin(out))

  want = loss_and_grads(lambda q, k, v: dot_product_attention(q, k, v, segments, **options))
  with on_devices(8), sharding.activate(sharding.create_mesh(config), config):
    got = jax.jit(lambda q, k, v: loss_and_grads(sharded))(q, k, v)
  assert_trees_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("balanced", [True, False])
def test_each_shard_computes_only_the_blocks_its_causal_mask_reaches(balanced):
  """The kernel's block lists, split over 4 context shards of 4096 tokens in 512-blocks: a
  shard's query block of tokens up to t runs the key blocks up to t's, the rest are skipped;
  balanced, shard i's chunks i and 7 - i run i + 1 and 8 - i: 9 blocks on every shard."""
  from MaxText.layers.attentions import splash_kernel
  length, context = 4096, 4
  order = context_parallel.balanced_order(length, context) if balanced else np.arange(length)
  kernel = splash_kernel(order, 0.0, None, context, length // context // (2 if balanced else 1))
  block_mask = np.asarray(kernel.fwd_mask_info.block_mask)[0]  # [query blocks, key blocks (those run)]
  ran = (block_mask.reshape(context, -1, block_mask.shape[-1]) != 0).sum(axis=(1, 2))
  last_tokens = order.reshape(context, -1, 512).max(axis=2)
  np.testing.assert_array_equal(ran, (last_tokens // 512 + 1).sum(axis=1))
  if balanced:
    assert ran.tolist() == [9] * context


@pytest.mark.parametrize("window, chunk", [(None, None), (40, None), (None, 48), (40, 48)])
def test_splash_masks_blocks_are_every_pairs_visibility(window, chunk):
  """Splash's mask as the kernel reads it, a block at a time (whole blocks seen or unseen told
  from their extreme tokens): every block of 20 queries x 24 keys equals masks.visible of each
  (query, key) pair, queries in a load-balanced context order (runs of 30 tokens, so blocks
  straddle them and the diagonal), with a window, Llama 4's chunks, both, neither."""
  from MaxText.layers import masks
  from MaxText.layers.attentions import splash_mask
  order = context_parallel.balanced_order(240, 4)
  mask = splash_mask(order, window, chunk)
  for q in range(0, 240, 20):
    for k in range(0, 240, 24):
      want = masks.visible(order[q:q + 20, None], np.arange(k, k + 24)[None], window, chunk)
      np.testing.assert_array_equal(mask[q:q + 20, k:k + 24], want, err_msg=f"block {q}, {k}")


def test_model_with_flash_per_context_shard_equals_one_device(monkeypatch):
  """The whole model (tiny, GQA 4/2, two layers in a scan) at 512 tokens on context 2 x fsdp 2 x
  tensor 2, load-balanced, packed documents across the shards: its summed loss and every gradient
  equal one device's with dot_product attention. pyconfig refuses the flash kernels on CPU, so
  the CPU config gets attention=flash and the TPU platform by hand, and the kernel runs in
  Pallas's interpreter."""
  from conftest import loss_gradients
  from test_context_parallel import packed_batch

  from MaxText import pyconfig
  from MaxText.layers.attentions import splash_kernel
  splash = context_parallel.ROW_KERNELS["flash"]["tpu"]
  monkeypatch.setitem(context_parallel.ROW_KERNELS["flash"], "tpu", splash._replace(
      make=lambda *args, **options: splash_kernel(*args[:-1], interpret=True, **options)))
  one_device = tiny_config("max_target_length=512", "per_device_batch_size=2")
  want = loss_gradients(one_device, packed_batch(one_device))
  with on_devices(8):
    config = tiny_config("max_target_length=512", "per_device_batch_size=0.25", "ici_context_parallelism=2",
                         "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
    config = pyconfig.Config({**config.to_dict(), "attention": "flash", "platform": "tpu"})
    got = loss_gradients(config, packed_batch(config))
  assert_trees_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("strategy, attention, balanced", [
    ("ring", "dot_product", True), ("all_gather", "chunked", False), ("all_gather", "flash", True)])
def test_sinks_per_context_shard_equal_one_device(strategy, attention, balanced):
  """GPT-OSS's sinks under context 2 x tensor 2 x fsdp 2 (the sinks split with the heads): the
  XLA blocks of both strategies (each sink a term of the merged logsumexp) and splash in Pallas's
  interpreter (its own), values and the gradients of q, k, v and the sinks, against one device's
  dot-product attention with them."""
  length = 512
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, heads, 32)), jnp.float32) for heads in (4, 2, 2))
  sinks = jnp.asarray([2.0, -1.0, 0.5, 4.0], jnp.float32)
  segments = packed_segments(length)
  with on_devices(8):
    config = tiny_config("ici_context_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                         f"max_target_length={length}", f"context_parallel_load_balance={balanced}",
                         f"context_parallel_strategy={strategy}", "attention_chunk_size=128", "attention_sink=true")
  order = context_parallel.balanced_order(length, 2) if balanced else np.arange(length)
  cfg = types.SimpleNamespace(**{**config.to_dict(), "attention": attention,
                                 "platform": "tpu" if attention == "flash" else config.platform})

  def sharded(q, k, v, sinks):
    q, k, v, stored = (jnp.take(x, order, axis=1) for x in (q, k, v, segments))
    out = context_parallel.attention(q, k, v, stored, cfg, 0.2, lambda scores: scores, None, interpret=True,
                                     sinks=sinks)
    return jnp.take(out, np.argsort(order), axis=1)

  def loss_and_grads(attend):
    out, vjp = jax.vjp(attend, q, k, v, sinks)
    return out, vjp(jnp.cos(out))

  want = loss_and_grads(lambda q, k, v, sinks: dot_product_attention(q, k, v, segments, 0.2, sinks=sinks))
  with on_devices(8), sharding.activate(sharding.create_mesh(config), config):
    got = jax.jit(lambda q, k, v, sinks: loss_and_grads(sharded))(q, k, v, sinks)
  assert_trees_close(got, want, rtol=1e-5)
