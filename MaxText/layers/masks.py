"""What a query may see and how its scores are formed: the one description of attention's
semantics that every kernel is driven by.

A query at token index q sees a key at token index k of its own packed document (equal segment
ids) when k <= q, and with a sliding window W when q - k < W too (its own token included). Token
indices are positions in the whole row, in whatever order a kernel holds the tokens (a context
shard's, a splash kernel's q_sequence). Scores are scale * q.k, through the soft cap where set.
A kernel takes the documents its own way (a segment-id mask, splash's SegmentIds, cuDNN's
offsets); the rest of the mask comes from `visible`.
"""

# The features beyond causal, documents and the query scale, each with the config key that asks
# for it: a kernel states which it takes (attentions.FlashKernel.takes), and a config asking a
# kernel for one it lacks is refused naming the key.
FEATURES = {"soft_cap": "attn_logits_soft_cap", "window": "sliding_window_size"}


def visible(q_index, k_index, window=None):
  """Whether queries at token indices q_index see keys at k_index (NumPy or JAX arrays of indices,
  broadcast against each other; `window` None, a number, or a traced one): causal, and within the
  window."""
  distance = q_index - k_index
  return distance >= 0 if window is None else (distance >= 0) & (distance < window)


def asked(cfg) -> list[str]:
  """The FEATURES a config's attention uses (cfg: the config, or its dict of values)."""
  value = cfg.get if isinstance(cfg, dict) else lambda key: getattr(cfg, key)
  return [feature for feature, key in FEATURES.items() if value(key)]


def refused(cfg, kernel: str, takes) -> str | None:
  """One line naming the first key whose feature `kernel` (which takes `takes`) lacks, or None."""
  missing = [feature for feature in asked(cfg) if feature not in takes]
  if not missing:
    return None
  key = FEATURES[missing[0]]
  value = cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)
  return (f"{key}={value!r}: must be 0 for attention=flash with flash_kernel={kernel} (the kernel has no "
          f"{missing[0].replace('_', ' ')}); use attention=chunked or another flash_kernel")
