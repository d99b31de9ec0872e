"""Attention's one description: masks.visible against a loop over token pairs, every flash kernel
refusing exactly the features its record does not take (one line naming the key), and a Pallas
kernel that declares no FLOPs stopping the count instead of counting zero."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from MaxText import costs
from MaxText.layers import masks
from MaxText.layers.attentions import FLASH_KERNELS, flash_attention


@pytest.mark.parametrize("window", [None, 1, 3])
def test_visible_is_causal_within_the_window_for_numpy_and_jax(window):
  index = np.arange(7)
  want = np.array([[k <= q and (window is None or q - k < window) for k in index] for q in index])
  np.testing.assert_array_equal(masks.visible(index[:, None], index[None, :], window), want)
  traced = jax.jit(lambda w: masks.visible(jnp.arange(7)[:, None], jnp.arange(7)[None, :], w))
  np.testing.assert_array_equal(traced(window if window else 7), want)


@pytest.mark.parametrize("kernel", sorted(FLASH_KERNELS))
def test_each_flash_kernel_refuses_what_its_record_does_not_take(kernel):
  """For every feature: a kernel that takes it is not refused; one that does not is refused in
  one line naming the feature's key, by pyconfig's check and by flash_attention alike."""
  takes = FLASH_KERNELS[kernel].takes
  q = jnp.zeros((1, 8, 2, 4))
  for feature, key in masks.FEATURES.items():
    asked = {"attn_logits_soft_cap": 0.0, "sliding_window_size": 0, key: 2}
    refusal = masks.refused(asked, kernel, takes)
    if feature in takes:
      assert refusal is None
      continue
    assert refusal.startswith(f"{key}=2: must be 0 for attention=flash with flash_kernel={kernel}")
    assert "\n" not in refusal
    with pytest.raises(ValueError, match=f"^{key}=2: must be 0"):
      flash_attention(q, q, q, jnp.ones((1, 8), jnp.int32), kernel, soft_cap=asked["attn_logits_soft_cap"],
                      window=asked["sliding_window_size"] or None)


def test_a_pallas_kernel_without_declared_flops_or_an_estimate_stops_the_count():
  def double(x_ref, o_ref):
    o_ref[...] = 2 * x_ref[...]

  call = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True, name="double")
  jaxpr = jax.make_jaxpr(call)(jnp.ones(8))
  with pytest.raises(ValueError, match="Pallas kernel 'double' declares no FLOPs"):
    costs.matmul_flops(jaxpr)
