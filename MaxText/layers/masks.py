"""What a query may see and how its scores are formed: the one description of attention's
semantics that every kernel is driven by.

A query at token index q sees a key at token index k of its own packed document (equal segment
ids) when k <= q, with a sliding window W when q - k < W too (its own token included), and with
attention chunks of C tokens (Llama 4) when q // C == k // C: both in the same chunk of the row. Token
indices are positions in the whole row, in whatever order a kernel holds the tokens (a context
shard's, a splash kernel's q_sequence). Scores are scale * q.k, through the soft cap where set;
with sinks (GPT-OSS) each head's softmax has one more score, a learned logit whose value is zero.
A kernel takes the documents its own way (a segment-id mask, splash's SegmentIds, cuDNN's
offsets); the rest of the mask comes from `visible`.
"""

# The features beyond causal, documents and the query scale, each with the config key that asks
# for it: a kernel states which it takes (attentions.FlashKernel.takes), and a config asking a
# kernel for one it lacks is refused naming the key.
FEATURES = {"soft_cap": "attn_logits_soft_cap", "window": "sliding_window_size", "chunk": "chunk_attn_window_size",
            "sink": "attention_sink"}


def visible(q_index, k_index, window=None, chunk=None):
  """Whether queries at token indices q_index see keys at k_index (NumPy or JAX arrays of indices,
  broadcast against each other; `window` and `chunk` None, a number, or a traced one): causal,
  within the window and within the chunk."""
  distance = q_index - k_index
  seen = distance >= 0 if window is None else (distance >= 0) & (distance < window)
  return seen if chunk is None else seen & (q_index // chunk == k_index // chunk)


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
  off = "false" if isinstance(value, bool) else "0"
  return (f"{key}={value!r}: must be {off} for attention=flash with flash_kernel={kernel} (the kernel has no "
          f"{missing[0].replace('_', ' ')}); use attention=chunked or another flash_kernel")
