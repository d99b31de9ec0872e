"""Ahead-of-time sizing: python -m MaxText.train_compile configs/base.yml [key=value ...]

Lowers and compiles exactly the train step that `MaxText.train` runs (same config, same
mesh, same shardings), runs nothing, and prints the compiled per-device memory against the
device's, the step's FLOPs and the MFU it would reach at the chip's peak, and the bytes each
device sends over the network per step, between slices (dcn) and within one (ici), by mesh
axes. Exit code 1 when it does not fit. Devices: the visible ones; a TPU slice with
compile_topology (libtpu compiles for it on any machine):
  python -m MaxText.train_compile configs/base.yml model_name=llama3-8b compile_topology=v5p-256 \\
    compile_topology_num_slices=2 dcn_data_parallelism=2 num_vocab_tiling=8
or N simulated CPU devices: JAX_NUM_CPU_DEVICES=N python -m MaxText.train_compile ...
"""

import sys

from MaxText import (
  accelerators,
  costs,
  errors,
  hlo_network,
  launch,
  metrics,
  run_control,
  runtime,
  sharding,
  train_step,
)
from MaxText.layers import pipeline


def main(argv):
  config = launch.config(argv[1:], plans=True)
  if config.memory_stats_file:
    run_control.check_writable("memory_stats_file", config.memory_stats_file, is_file=True)
  trainer = train_step.build(config, sharding.create_mesh(config))
  try:
    compiled = train_step.compile_train_step(trainer, config)
  except errors.UserError as e:
    if config.memory_stats_file:
      metrics.write_json(config.memory_stats_file, {"fits": False, "error": str(e)})
    raise
  device = trainer.mesh.devices.flat[0]
  where = (f"{config.compile_topology} x {config.compile_topology_num_slices} slice(s)" if config.compile_topology
           else device.platform)
  stats = costs.memory_stats(compiled)
  report, problem = costs.memory_report(stats, trainer.mesh)
  print(f"train step memory per device ({config.num_devices} {device.device_kind} devices of {where}, "
        f"mesh {config.mesh_shape}, dcn {config.dcn_mesh_shape}):")
  print(costs.format_memory_stats(stats))
  limit = report["device_memory_bytes"]
  if limit:
    print(f"  device memory   {limit:16,d} bytes  {limit / 2**30:9.3f} GiB  ({device.device_kind})")
  if config.pipeline_stages > 1:
    report["pipeline_bubble"] = pipeline.bubble(config)
    print(f"pipeline: {config.pipeline_stages} stages x {config.num_pipeline_repeats} repeat(s), "
          f"{config.num_pipeline_microbatches} microbatches, {config.pipeline_schedule}: the stages idle "
          f"{report['pipeline_bubble']:.1%} of the loop (the bubble); each device's memory above is its stage's")
  report["largest_vocab_arrays"] = costs.largest_vocab_arrays(compiled, config.vocab_size, config.num_devices)
  print("largest arrays with a vocabulary dimension, per device:")
  print("\n".join(f"  {shape:28s} {size / 2**20:12,.1f} MiB" for shape, size in report["largest_vocab_arrays"]))
  report.update(costs.flops_report(config, train_step.trace_train_step(trainer, config).jaxpr))
  model_flops, step_flops = report["model_flops_per_step"], report["traced_flops_per_step"]
  by_precision = report["traced_flops_by_precision"]
  chip = accelerators.chip_of(device.device_kind)
  print(f"FLOPs per step, all devices: model {model_flops:.4g}; matmuls and attention kernels as traced "
        f"{step_flops:.4g} ({step_flops / model_flops - 1:+.1%}: recomputation, and the causal mask's half of the "
        "attention products)")
  if len(by_precision) > 1:
    print("  of which multiplied in " + ", ".join(f"{kind} {flops:.4g}" for kind, flops in by_precision.items()))
    report["compiled_products"] = costs.compiled_products(compiled.as_text())
    print("  the compiled step's matrix products by operand types: "
          + ", ".join(f"{types} {count}" for types, count in report["compiled_products"].items()))
  if chip:
    seconds = costs.seconds_at_peak(by_precision, chip, config.num_devices)
    peaks = ", ".join(f"{kind} {chip.peak_tflops(kind):g}" + (" (no native fp8: XLA multiplies in bfloat16)"
                                                               if kind == "fp8" and not chip.peak_fp8_tflops else "")
                      for kind in by_precision)
    print(f"at the {device.device_kind} peak ({peaks} TFLOP/s): a step takes at least {seconds:.3g} s, "
          f"MFU at most {model_flops / (seconds * config.num_devices * chip.peak_bf16_tflops * 1e12):.1%} of the "
          "bf16 peak")
  if report["collective_bytes_per_device"]:
    print("collectives called in shard_map, GiB sent per device per step, by the mesh axes they run over (as "
          "traced): " + ", ".join(f"{axes} {bytes_ / 2**30:.3f}"
                                  for axes, bytes_ in report["collective_bytes_per_device"].items()))
  network = report["network_bytes_per_device"] = hlo_network.network_bytes(compiled.as_text(), trainer.mesh)
  print(f"network bytes per device per step (the compiled step's collectives, the partitioner's included): "
        f"across slices (dcn) {network['dcn'] / 2**30:.3f} GiB, within a slice (ici) {network['ici'] / 2**30:.3f} GiB")
  for axes, sent in network["by_axes"].items():
    print(f"  over {axes:28s} dcn {sent['dcn'] / 2**30:10.3f} GiB  ici {sent['ici'] / 2**30:10.3f} GiB")
  for kind, sent in sorted(network["by_type"].items(), key=lambda item: -sum(item[1].values())):
    print(f"  as {kind:30s} dcn {sent['dcn'] / 2**30:10.3f} GiB  ici {sent['ici'] / 2**30:10.3f} GiB")
  if network["unknown_trip_counts"]:
    print(f"warning: {network['unknown_trip_counts']} loop(s) with collectives of a trip count the compiled HLO does "
          "not say, counted once", file=sys.stderr)
  if config.memory_stats_file:
    metrics.write_json(config.memory_stats_file, report)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    sys.exit(1)

if __name__ == "__main__":
  runtime.run(main)
