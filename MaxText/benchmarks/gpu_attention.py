"""Attention kernels on one GPU: python -m MaxText.benchmarks.gpu_attention

Forward plus backward of causal attention at llama3.2-1b's shapes (32 query heads, 8 key/value
heads of 64, bfloat16), 4 x 8,192 and 1 x 65,536 tokens, with one document per row and with
DOCUMENTS packed documents of unequal lengths per row:
- `attention=flash` as the model runs it (`attentions.flash_attention`) with each GPU
  `flash_kernel`: cudnn (cuDNN's fused attention, documents as offsets) and triton (JAX's
  Pallas Triton kernel with this project's block sizes, documents as segment ids);
- with one document: the Triton kernel with JAX's default block sizes (32 x 32 in the
  backward), and cuDNN through `jax.nn.dot_product_attention` (no documents: the cost of the
  offsets).
TFLOP/s counts the causal half of each document's score matrix: 2 matmuls forward, 5 backward.
Results go to attention_gpu.{md,json,png}.
"""

import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import common, provenance
from MaxText.layers import attentions

SHAPES = ((4, 8192), (1, 65536))  # (rows, tokens)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
DOCUMENTS = 8


def segment_ids(rows: int, tokens: int, documents: int) -> np.ndarray:
  """Documents of unequal lengths whose boundaries fall inside kernel blocks."""
  bounds = (tokens * (np.arange(1, documents) / documents) ** 1.5).astype(int) + 37
  return np.tile(np.searchsorted(bounds, np.arange(tokens), side="right") + 1, (rows, 1)).astype(np.int32)


def kernels(segments, documents):
  from jax.experimental.pallas.ops.gpu import attention as triton  # noqa: PLC0415 (GPU kernels)

  def triton_default_blocks(q, k, v):
    k, v = (jnp.repeat(x, HEADS // KV_HEADS, axis=2) for x in (k, v))
    return triton.mha(q, k, v, segments, sm_scale=HEAD_DIM**-0.5, causal=True)

  ours = {f"attention=flash, flash_kernel={name}": functools.partial(
      attentions.flash_attention, segment_ids=segments, kernel_name=name, max_segments=documents + 1)
      for name in ("cudnn", "triton")}
  if documents > 1:
    return ours
  return {**ours, "Triton, JAX's default blocks": triton_default_blocks,
          "cuDNN through jax.nn (no documents)": lambda q, k, v: jax.nn.dot_product_attention(
              q, k, v, is_causal=True, implementation="cudnn")}


def seconds(f, q, k, v, reps):
  step = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
  jax.block_until_ready(step(q, k, v))
  start = time.perf_counter()
  for _ in range(reps):
    out = step(q, k, v)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / reps


def main():
  args = common.parse_args(__doc__, steps=5)
  results = {}
  for (rows, tokens), documents in itertools.product(SHAPES, (1, DOCUMENTS)):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, tokens, HEADS, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(key, (rows, tokens, KV_HEADS, HEAD_DIM), jnp.bfloat16) for key in keys[1:])
    segments = segment_ids(rows, tokens, documents)
    pairs = sum(n * n / 2 for n in np.unique(segments[0], return_counts=True)[1])
    flops = 7 * 2 * rows * pairs * HEADS * HEAD_DIM
    for name, f in kernels(jnp.asarray(segments), documents).items():
      label = f"{rows} x {tokens:,}, {documents} document{'s' * (documents > 1)}: {name}"
      s = seconds(f, q, k, v, args.steps)
      results[label] = {"seconds": s, "tflops": flops / s / 1e12, "device_kind": jax.devices()[0].device_kind}
      print(label, results[label], flush=True)
  kind = jax.devices()[0].device_kind
  rows = [[name, f"{r['seconds'] * 1e3:,.1f}", f"{r['tflops']:.0f}"] for name, r in results.items()]
  markdown = (f"# Attention kernels, forward + backward, on one {kind}\n\n"
              f"`python -m MaxText.benchmarks.gpu_attention`; {HEADS} query heads, {KV_HEADS} key/value heads of "
              f"{HEAD_DIM}, bfloat16, causal within each document; TFLOP/s over the causal half of each "
              "document's scores\n\n"
              + reports.markdown_table(["kernel", "ms", "TFLOP/s"], rows))
  figure = Figure(figsize=(9, 0.5 * len(results) + 1.5))
  axis = figure.subplots()
  axis.barh(list(results), [r["tflops"] for r in results.values()])
  axis.set_xlabel("TFLOP/s (causal half, forward + backward)")
  axis.invert_yaxis()
  provenance.save(args.output_dir, "attention_gpu", markdown, {"results": results}, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
