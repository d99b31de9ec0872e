"""Attention's one description: masks.visible against a loop over token pairs, every flash kernel
refusing exactly the features its record does not take (one line naming the key), and a Pallas
kernel that declares no FLOPs stopping the count instead of counting zero."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_devices, tiny_config
from jax.experimental import pallas as pl

from MaxText import costs, errors
from MaxText.layers import masks
from MaxText.layers.attentions import FLASH_KERNELS, flash_attention


@pytest.mark.parametrize("window, chunk", [(None, None), (1, None), (3, None), (None, 3), (None, 1)])
def test_visible_is_causal_within_the_window_and_the_chunk_for_numpy_and_jax(window, chunk):
  index = np.arange(7)
  want = np.array([[k <= q and (window is None or q - k < window) and (chunk is None or q // chunk == k // chunk)
                    for k in index] for q in index])
  np.testing.assert_array_equal(masks.visible(index[:, None], index[None, :], window, chunk), want)
  # Traced, as in a scan: a layer that is not local takes the row length, which masks nothing.
  traced = jax.jit(lambda w, c: masks.visible(jnp.arange(7)[:, None], jnp.arange(7)[None, :], w, c))
  np.testing.assert_array_equal(traced(window or 7, chunk or 7), want)


@pytest.mark.parametrize("kernel", sorted(FLASH_KERNELS))
def test_each_flash_kernel_refuses_what_its_record_does_not_take(kernel):
  """For every feature: a kernel that takes it is not refused; one that does not is refused in
  one line naming the feature's key, by pyconfig's check and by flash_attention alike."""
  takes = FLASH_KERNELS[kernel].takes
  q = jnp.zeros((1, 8, 2, 4))
  for feature, key in masks.FEATURES.items():
    asked = {"attn_logits_soft_cap": 0.0, "sliding_window_size": 0, "chunk_attn_window_size": 0, key: 2}
    refusal = masks.refused(asked, kernel, takes)
    if feature in takes:
      assert refusal is None
      continue
    assert refusal.startswith(f"{key}=2: must be 0 for attention=flash with flash_kernel={kernel}")
    assert "\n" not in refusal
    with pytest.raises(ValueError, match=f"^{key}=2: must be 0"):
      flash_attention(q, q, q, jnp.ones((1, 8), jnp.int32), kernel, soft_cap=asked["attn_logits_soft_cap"],
                      window=asked["sliding_window_size"] or None,
                      chunk_window=asked["chunk_attn_window_size"] or None)


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
