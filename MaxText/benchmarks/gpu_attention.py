"""Attention kernels on one GPU: python -m MaxText.benchmarks.gpu_attention

Forward plus backward of causal attention at llama3.2-1b's shapes (32 query heads, 8 key/value
heads of 64, bfloat16), 4 x 8,192 and 1 x 65,536 tokens, one document per row:
- `attention=flash` as the model runs it (`attentions.flash_attention`, JAX's Pallas Triton
  kernel with this project's block sizes);
- the same kernel with JAX's default block sizes (32 x 32 in the backward);
- cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`), which the
  model does not use: its packed documents are offsets, not segment ids.
TFLOP/s counts the causal half of the score matrix: 2 matmuls forward, 5 backward.
Results go to attention_gpu.{md,json,png}.
"""

import time

import jax
import jax.numpy as jnp
from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import common, provenance
from MaxText.layers import attentions

SHAPES = ((4, 8192), (1, 65536))  # (rows, tokens)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64


def kernels(segment_ids):
  from jax.experimental.pallas.ops.gpu import attention as triton  # noqa: PLC0415 (GPU kernels)

  def triton_default_blocks(q, k, v):
    k, v = (jnp.repeat(x, HEADS // KV_HEADS, axis=2) for x in (k, v))
    return triton.mha(q, k, v, segment_ids, sm_scale=HEAD_DIM**-0.5, causal=True)

  return {
      "attention=flash (Triton, our blocks)": lambda q, k, v: attentions.flash_attention(q, k, v, segment_ids, "gpu"),
      "Triton, JAX's default blocks": triton_default_blocks,
      "cuDNN (no segment ids)": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                               implementation="cudnn"),
  }


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
  for rows, tokens in SHAPES:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, tokens, HEADS, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(key, (rows, tokens, KV_HEADS, HEAD_DIM), jnp.bfloat16) for key in keys[1:])
    flops = 7 * 2 * rows * tokens * tokens * HEADS * HEAD_DIM / 2
    for name, f in kernels(jnp.ones((rows, tokens), jnp.int32)).items():
      s = seconds(f, q, k, v, args.steps)
      results[f"{rows} x {tokens:,}: {name}"] = {"seconds": s, "tflops": flops / s / 1e12,
                                                 "device_kind": jax.devices()[0].device_kind}
      print(name, rows, tokens, results[f"{rows} x {tokens:,}: {name}"], flush=True)
  kind = jax.devices()[0].device_kind
  rows = [[name, f"{r['seconds'] * 1e3:,.1f}", f"{r['tflops']:.0f}"] for name, r in results.items()]
  markdown = (f"# Attention kernels, forward + backward, on one {kind}\n\n"
              f"`python -m MaxText.benchmarks.gpu_attention`; {HEADS} query heads, {KV_HEADS} key/value heads of "
              f"{HEAD_DIM}, bfloat16, causal\n\n"
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
