"""Attention's one description: masks.visible against a loop over token pairs, sinks against NumPy
in every XLA kernel and in splash (Pallas's interpreter), every flash kernel refusing exactly the
features its record does not take (one line naming the key), and a Pallas kernel that declares no
FLOPs stopping the count instead of counting zero."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_devices, tiny_config
from jax.experimental import pallas as pl

from MaxText import costs, errors
from MaxText.layers import masks
from MaxText.layers.attentions import FLASH_KERNELS, chunked_attention, dot_product_attention, flash_attention


@pytest.mark.parametrize("window, chunk", [(None, None), (1, None), (3, None), (None, 3), (None, 1)])
def test_visible_is_causal_within_the_window_and_the_chunk_for_numpy_and_jax(window, chunk):
  index = np.arange(7)
  want = np.array([[k <= q and (window is None or q - k < window) and (chunk is None or q // chunk == k // chunk)
                    for k in index] for q in index])
  np.testing.assert_array_equal(masks.visible(index[:, None], index[None, :], window, chunk), want)
  # Traced, as in a scan: a layer that is not local takes the row length, which masks nothing.
  traced = jax.jit(lambda w, c: masks.visible(jnp.arange(7)[:, None], jnp.arange(7)[None, :], w, c))
  np.testing.assert_array_equal(traced(window or 7, chunk or 7), want)


def sink_inputs(length, seed=0):
  """GQA rows (4 query heads, 2 key/value heads) of two packed documents, and the heads' sinks:
  large enough, positive and negative, that they take much of a softmax or little."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(1, length, heads, 32)), jnp.float32) for heads in (4, 2, 2))
  segments = jnp.asarray((np.arange(length) >= length * 5 // 8)[None] + 1, jnp.int32)
  return q, k, v, segments, jnp.asarray([3.0, -2.0, 0.5, 6.0], jnp.float32)


def numpy_sink_attention(q, k, v, segments, sinks, scale):
  """Each head's softmax over its visible keys' scores and its sink, a loop over heads and queries."""
  q, k, v, segments, sinks = map(np.asarray, (q, k, v, segments, sinks))
  out = np.zeros(q.shape)
  groups = q.shape[2] // k.shape[2]
  for n in range(q.shape[2]):
    for t in range(q.shape[1]):
      seen = [s for s in range(t + 1) if segments[0, s] == segments[0, t]]
      scores = np.array([scale * q[0, t, n] @ k[0, s, n // groups] for s in seen] + [sinks[n]])
      probs = np.exp(scores - scores.max())
      probs /= probs.sum()
      out[0, t, n] = probs[:-1] @ v[0, seen, n // groups]
  return out


def test_sinks_in_the_xla_kernels_are_numpys_and_their_gradients_agree():
  """GPT-OSS's sinks: dot-product and chunked attention against a NumPy loop; their gradients,
  the sinks' included, equal each other."""
  q, k, v, segments, sinks = sink_inputs(16)
  kernels = {"dot_product": lambda *a: dot_product_attention(*a[:4], 0.2, sinks=a[4]),
             "chunked": lambda *a: chunked_attention(*a[:4], 4, 0.2, sinks=a[4])}
  want = numpy_sink_attention(q, k, v, segments, sinks, 0.2)
  grads = {}
  for name, attend in kernels.items():
    out, vjp = jax.vjp(lambda q, k, v, sinks, attend=attend: attend(q, k, v, segments, sinks), q, k, v, sinks)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6, err_msg=name)
    grads[name] = vjp(jnp.cos(out))
  for got, ref in zip(grads["chunked"], grads["dot_product"]):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  assert np.abs(grads["dot_product"][3]).min() > 0  # every sink is trained


def test_splash_takes_sinks_in_the_pallas_interpreter():
  """TPU's splash with the heads' sinks (Pallas's interpreter, 256 tokens, GQA, two documents):
  values and the gradients of queries, keys, values and sinks equal dot-product attention's."""
  q, k, v, segments, sinks = sink_inputs(256, seed=1)

  def loss_and_grads(attend):
    out, vjp = jax.vjp(lambda q, k, v, sinks: attend(q, k, v, segments, scale=0.2, sinks=sinks), q, k, v, sinks)
    return out, vjp(jnp.cos(out))

  want = loss_and_grads(dot_product_attention)
  got = loss_and_grads(lambda *args, **kwargs: flash_attention(*args, kernel_name="splash", interpret=True, **kwargs))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(FLASH_KERNELS))
def test_each_flash_kernel_refuses_what_its_record_does_not_take(kernel):
  """For every feature: a kernel that takes it is not refused; one that does not is refused in
  one line naming the feature's key, by pyconfig's check and by flash_attention alike."""
  takes = FLASH_KERNELS[kernel].takes
  q = jnp.zeros((1, 8, 2, 4))
  for feature, key in masks.FEATURES.items():
    on = True if key == "attention_sink" else 2
    asked = {"attn_logits_soft_cap": 0.0, "sliding_window_size": 0, "chunk_attn_window_size": 0,
             "attention_sink": False, key: on}
    refusal = masks.refused(asked, kernel, takes)
    if feature in takes:
      assert refusal is None
      continue
    off = "false" if on is True else "0"
    assert refusal.startswith(f"{key}={on!r}: must be {off} for attention=flash with flash_kernel={kernel}")
    assert "\n" not in refusal
    with pytest.raises(ValueError, match=f"^{key}={on!r}: must be {off}"):
      flash_attention(q, q, q, jnp.ones((1, 8), jnp.int32), kernel, soft_cap=asked["attn_logits_soft_cap"],
                      window=asked["sliding_window_size"] or None,
                      chunk_window=asked["chunk_attn_window_size"] or None,
                      sinks=jnp.zeros(2) if asked["attention_sink"] else None)


@pytest.mark.parametrize("overrides, message", [
    (("chunk_attn_window_size=4", "sliding_window_size=4"), "chunk_attn_window_size=4: and sliding_window_size=4 "
                                                              "cannot both be set"),
    (("temperature_tuning=true",), "temperature_tuning=True: tunes the NoPE layers' queries: set nope_layer_interval"),
    (("chunk_attn_window_size=4", "ici_context_parallelism=2"), "chunk_attn_window_size=4: must be 0 with context "
                                                                  "parallelism (2 context shards)"),
])
def test_what_the_attention_description_cannot_take_is_one_line_naming_the_key(overrides, message):
  with on_devices(8), pytest.raises(errors.ConfigError, match=re.escape(message)):
    tiny_config(*overrides)


def test_a_pallas_kernel_without_declared_flops_or_an_estimate_stops_the_count():
  def double(x_ref, o_ref):
    o_ref[...] = 2 * x_ref[...]

  call = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True, name="double")
  jaxpr = jax.make_jaxpr(call)(jnp.ones(8))
  with pytest.raises(ValueError, match="Pallas kernel 'double' declares no FLOPs"):
    costs.matmul_flops(jaxpr)
