"""cuDNN's packed-document attention on a GPU: python -m MaxText.benchmarks.cudnn_packed

What flash_kernel=cudnn relies on, checked where cuDNN runs (it has no CPU or interpreter path):
- each case: attentions.document_offsets' lengths and starts into cuDNN's fused attention (as
  attentions._cudnn_attention passes them), bfloat16, forward and backward, against
  dot_product attention in float32 on the same inputs and segment ids; printed: the largest
  error of the context and of each gradient over that tensor's largest magnitude (bfloat16's
  rounding is about 5e-3; a mask wrong anywhere gives about 1: NO_MASK is that control);
  2 x 2,048 tokens, 8 query heads of 64 and 8 (mha) or 2 (gqa) key/value heads, rows of one
  document, four aligned, five unaligned, or the gpu_attention benchmark's eight and a padding
  run, with the cap (max_segments) above the documents or equal to them;
- memory: the compiled temporaries of one attention's forward and backward at llama3.2-1b's
  4 x 8,192 tokens for cuDNN packed with 32 and with 2 document slots, cuDNN unpacked through
  jax.nn, and the Triton kernel.
Each case runs in its own process: a CUDA error ends the process that meets it.
"""

import json
import subprocess
import sys
import time

import numpy as np

LAYOUTS = ("one", "aligned", "unaligned", "bench")


def _segments(layout: str, rows: int, tokens: int) -> np.ndarray:
  if layout == "one":
    return np.ones((rows, tokens), np.int32)
  if layout == "aligned":
    return np.repeat(np.arange(1, 5), tokens // 4)[None].repeat(rows, 0).astype(np.int32)
  if layout == "bench":
    from MaxText.benchmarks.gpu_attention import segment_ids  # noqa: PLC0415 (the child process only)
    segments = segment_ids(rows, tokens, 8)
    segments[:, -100:] = 0
    return segments
  bounds = [127, 289, 480, 1200]
  return (np.searchsorted(bounds, np.arange(tokens), side="right") + 1)[None].repeat(rows, 0).astype(np.int32)


def errors(mask: str, heads: str, layout: str, backward: bool, max_segments: int = 8) -> list:
  import jax  # noqa: PLC0415 (each case starts JAX in its own process)
  import jax.numpy as jnp  # noqa: PLC0415
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 (see attentions._cudnn_attention)

  from MaxText.layers import attentions  # noqa: PLC0415
  rows, tokens, query_heads = 2, 2048, 8
  kv_heads = 2 if heads == "gqa" else query_heads
  segments = jnp.asarray(_segments(layout, rows, tokens))
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (rows, tokens, query_heads, 64), jnp.bfloat16)
  k, v = (jax.random.normal(key, (rows, tokens, kv_heads, 64), jnp.bfloat16) for key in keys[1:3])
  cotangent = jax.random.normal(keys[3], (rows, tokens, query_heads, 64), jnp.bfloat16)
  lengths, offsets = attentions.document_offsets(segments, max_segments)

  def fused(q, k, v):
    return cudnn.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                       kv_offsets=offsets, scale=0.125, mask_type=getattr(cudnn.MaskType, mask))

  def reference(q, k, v):
    return attentions.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), segments, 0.125)

  def values_and_grads(attend):
    out, vjp = jax.vjp(attend, q, k, v)
    grads = vjp(cotangent.astype(out.dtype)) if backward else ()
    return [x.astype(jnp.float32) for x in (out, *grads)]

  got, want = jax.jit(lambda: values_and_grads(fused))(), jax.jit(lambda: values_and_grads(reference))()
  return [round(float(jnp.abs(g - w).max() / jnp.abs(w).max()), 4) for g, w in zip(got, want)]


def memory() -> dict:
  import jax  # noqa: PLC0415 (as above)
  import jax.numpy as jnp  # noqa: PLC0415

  from MaxText.layers import attentions  # noqa: PLC0415
  q = jax.ShapeDtypeStruct((4, 8192, 32, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((4, 8192, 8, 64), jnp.bfloat16)
  segments = jnp.ones((4, 8192), jnp.int32)
  kernels = {
      "cudnn packed M=32": lambda q, k, v: attentions.flash_attention(q, k, v, segments, "cudnn", max_segments=32),
      "cudnn packed M=2": lambda q, k, v: attentions.flash_attention(q, k, v, segments, "cudnn", max_segments=2),
      "jax.nn cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
      "triton": lambda q, k, v: attentions.flash_attention(q, k, v, segments, "triton"),
  }
  result = {}
  for name, attend in kernels.items():
    step = jax.jit(jax.grad(lambda q, k, v, attend=attend: attend(q, k, v).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))
    result[name] = round(step.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes / 2**30, 3)
  return result


CASES = ([("memory",)]
         + [(mask, heads, layout, "1") for layout in LAYOUTS[:3] for heads in ("gqa", "mha")
            for mask in ("CAUSAL", "PADDING_CAUSAL")]
         + [("NO_MASK", "mha", "unaligned", "1"), ("CAUSAL", "gqa", "unaligned", "0"),
            ("CAUSAL", "gqa", "unaligned", "1", "5"), ("CAUSAL", "gqa", "bench", "1", "10"),
            ("CAUSAL", "gqa", "bench", "1", "9"), ("CAUSAL", "gqa", "unaligned", "1", "6")])


def main():
  if len(sys.argv) > 1:  # one case, in this process
    case = sys.argv[1:]
    try:
      result = memory() if case[0] == "memory" else errors(*case[:3], case[3] == "1", *map(int, case[4:]))
    except Exception as e:  # reported as the case's result
      result = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    print("RESULT", json.dumps(result), flush=True)
    return
  for case in CASES:
    start = time.time()
    try:
      child = subprocess.run([sys.executable, "-m", __spec__.name, *case], capture_output=True, text=True, timeout=90)
      line = next((out for out in child.stdout.splitlines() if out.startswith("RESULT")), None)
      result = line[len("RESULT "):] if line else "CRASH " + (child.stderr.strip().splitlines() or ["?"])[-1][:200]
    except subprocess.TimeoutExpired:
      result = "TIMEOUT"
    print(" ".join(case), "->", result, f"({time.time() - start:.0f}s)", flush=True)


if __name__ == "__main__":
  main()
