"""The run's metrics: each step's perf/* figures (StepClock), the log line, the JSONL metrics file
and TensorBoard (MetricLogger), and memory_stats_file (write_json). What a step costs is in
costs.py."""

import json
import os
import time

import jax
from absl import logging

from MaxText.costs import peak_tflops, training_flops_per_step


def write_json(path: str, record: dict) -> None:
  """memory_stats_file: `record` as JSON, its folder made if need be."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(record, f, indent=2)


class StepClock:
  """The perf/* metrics of each finished step: the time since the previous one finished (a step's
  time once the host keeps the device busy), tokens/s and TFLOP/s per device, and MFU (model
  FLOPs only, recomputation not counted) against the chip's peak where it is known."""

  def __init__(self, config, device_kind: str):
    self.flops_per_device = training_flops_per_step(config) / config.num_devices
    self.tokens_per_device = config.global_batch_size_to_train_on * config.max_target_length / config.num_devices
    self.peak_tflops = peak_tflops(device_kind)
    self.last = time.perf_counter()

  def restart(self) -> None:
    """Time until now (an evaluation) is not step time."""
    self.last = time.perf_counter()

  def lap(self) -> dict:
    """The perf/* metrics of the step that finished just now."""
    now = time.perf_counter()
    seconds, self.last = now - self.last, now
    perf = {
        "perf/step_time_seconds": seconds,
        "perf/per_device_tokens_per_sec": self.tokens_per_device / seconds,
        "perf/per_device_tflops_per_sec": self.flops_per_device / seconds / 1e12,
    }
    if self.peak_tflops:
      perf["perf/mfu"] = perf["perf/per_device_tflops_per_sec"] / self.peak_tflops
    return perf


# (metric, label, format) of the log line, in order.
LOG_LINE = (
    ("learning/loss", "loss", "{:.4f}"),
    ("learning/accuracy", "acc", "{:.3f}"),
    ("learning/grad_norm", "grad_norm", "{:.3f}"),
    ("learning/current_learning_rate", "lr", "{:.2e}"),
    ("perf/step_time_seconds", "s", "{:.3f}"),
    ("perf/per_device_tokens_per_sec", "tokens/s/device", "{:,.0f}"),
    ("perf/per_device_tflops_per_sec", "TFLOP/s/device", "{:.3f}"),
    ("perf/mfu", "MFU", "{:.1%}"),
    ("eval/loss", "eval_loss", "{:.4f}"),
    ("eval/perplexity", "eval_ppl", "{:.2f}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
)


class MetricLogger:
  """Writes each step's scalars to the JSONL metrics file and TensorBoard, and logs a line
  every log_period steps. Only process 0 writes."""

  def __init__(self, config):
    self.config = config
    writer = jax.process_index() == 0
    if writer and config.metrics_file:
      os.makedirs(os.path.dirname(os.path.abspath(config.metrics_file)), exist_ok=True)
    self.file = open(config.metrics_file, "a") if writer and config.metrics_file else None
    self.tensorboard = None
    if writer and config.enable_tensorboard:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 (a run without TensorBoard starts without it)
      self.tensorboard = SummaryWriter(os.path.join(config.run_dir, "tensorboard"))

  def write(self, step: int, metrics: dict, force_log: bool = False):
    if self.file:
      self.file.write(json.dumps({"step": step, **metrics}) + "\n")
      self.file.flush()
    if self.tensorboard:
      for key, value in metrics.items():
        self.tensorboard.add_scalar(key, value, step)
    if force_log or step % self.config.log_period == 0:
      fields = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in LOG_LINE if key in metrics]
      logging.info("step %d/%d | %s", step, self.config.steps, " | ".join(fields))

  def close(self):
    if self.file:
      self.file.close()
    if self.tensorboard:
      self.tensorboard.close()
