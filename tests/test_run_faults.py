"""Faults of a training run's start, loop and end: nothing allocated for a step that cannot fit,
signals before the loop and a second signal end the process, a failed save stops the run,
a run ending inside a non-finite streak says so, and the smaller promises around them."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import BASE_YML, ROOT, TINY, run_command, tiny_config
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from MaxText import checkpointing, errors, launch, run_control, train
from MaxText.checkpoint_conversion import mapping
from MaxText.checkpointing import CheckpointError
from MaxText.errors import UserError

CHECKPOINTED = ("enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false")


def train_error(*args):
  """The UserError `train` stops with (runtime.run prints it as one line and exits with its code)."""
  with pytest.raises(UserError) as error:
    run_command("train", *TINY, *args)
  assert "\n" not in str(error.value)
  return error.value


def test_a_step_too_big_for_memory_fails_before_anything_is_allocated_or_written(tmp_path):
  # 65536 wide: about 80 GiB of parameters, more than this host's memory; nothing is allocated,
  # so the one line comes at once instead of a hang in the initialisation.
  error = train_error("base_emb_dim=65536", f"base_output_directory={tmp_path}", "run_name=big")
  assert error.exit_code == 1 and "does not fit" in str(error)
  assert not (tmp_path / "big").exists()


@pytest.mark.e2e
def test_a_signal_before_the_loop_ends_the_process_at_once(tmp_path):
  """SIGTERM while the state is restored or initialised: nothing to save yet, so the default
  action, not a step trained and saved after it."""
  script = (f"import os, signal, sys\nfrom MaxText import train\ninitial = train.initial_state\n"
            f"def signalled(*args):\n  os.kill(os.getpid(), signal.SIGTERM)\n  return initial(*args)\n"
            f"train.initial_state = signalled\nsys.argv = ['train', {BASE_YML!r}, *{TINY!r}, *{CHECKPOINTED!r}, "
            f"'base_output_directory={tmp_path}', 'run_name=r']\n"
            "from MaxText import runtime\nruntime.run(train.main)\n")
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
  assert "stack trace" not in result.stderr, result.stderr[-3000:]  # libtpu's handler prints a C++ stack for SIGTERM
  assert not (tmp_path / "r" / "checkpoints").exists() or not os.listdir(tmp_path / "r" / "checkpoints")


@pytest.mark.e2e
@pytest.mark.parametrize("signals", [
    "os.kill(os.getpid(), signal.SIGTERM)\n  print('one handled', flush=True)\n  os.kill(os.getpid(), signal.SIGTERM)",
    # both while the main thread is in one call into C (a step, a compile), 20 ms apart: Python
    # runs its handler once for the two
    "subprocess.Popen(['sh', '-c', f'sleep 0.5; kill -TERM {os.getpid()}; sleep 0.02; kill -TERM {os.getpid()}'])\n"
    "  hashlib.pbkdf2_hmac('sha256', b'', b'', 5_000_000)",
], ids=["after the first is handled", "20 ms apart in one C call"])
def test_a_second_signal_ends_the_process_at_once(signals):
  script = ("import hashlib, os, signal, subprocess\nfrom MaxText import run_control\n"
            f"with run_control.stop_signals() as received:\n  {signals}\n  print('survived the second')\n")
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
  assert "survived" not in result.stdout
  assert ("one handled" in result.stdout) == ("one handled" in signals)


def test_a_signal_to_a_tool_is_not_swallowed_by_a_librarys_except_exception():
  """prepare_data and the converters stop on SIGTERM with one line, wherever it lands: tqdm's
  `except Exception` around starting its monitor thread once took it and the tool ran on."""
  with pytest.raises(run_control.Preempted, match="SIGTERM before the output was complete") as stopped:
    with run_control.signals_raise():
      try:
        signal.raise_signal(signal.SIGTERM)
      except Exception:  # as tqdm's
        pass
      pytest.fail("the signal was swallowed")
  assert stopped.value.exit_code == 128 + signal.SIGTERM


def test_a_signal_while_to_maxtext_writes_stops_it_with_one_line_and_leaves_nothing(tmp_path, monkeypatch, capfd):
  """SIGTERM lands while orbax's writer thread writes the second layer: the writer stops at its
  next layer, the conversion's directories go, and the one line is the signal's, with none of
  the writer's tracebacks (the signal raised in the main thread at once left the writer running
  while the cleanup removed its output)."""
  to_param, layers = mapping.to_param, []

  def signalled(*args):
    layers.append(1)
    if len(layers) == 2:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.2)  # for the main thread to record it before the next layer
    return to_param(*args)

  monkeypatch.setattr(mapping, "to_param", signalled)
  threads = set(threading.enumerate())
  with pytest.raises(run_control.Preempted, match="SIGTERM before the output was complete") as stopped:
    run_command("checkpoint_conversion.to_maxtext", f"hf_model_path={ROOT / 'tests' / 'assets' / 'hf' / 'llama'}",
                f"base_output_directory={tmp_path / 'out'}", "run_name=imported")
  assert stopped.value.exit_code == 128 + signal.SIGTERM
  assert len(layers) == 2  # the writer read no layer after the signal
  assert set(threading.enumerate()) <= threads  # nor writes on
  assert not (tmp_path / "out").exists()
  assert "Traceback" not in capfd.readouterr().err


def test_an_unwritable_checkpoints_directory_is_one_line_before_step_1(tmp_path):
  (tmp_path / "r").mkdir()
  (tmp_path / "r" / "checkpoints").write_text("not a directory")
  error = train_error(*CHECKPOINTED, f"base_output_directory={tmp_path}", "run_name=r")
  assert error.exit_code == 2 and "checkpoints" in str(error)
  assert sorted(os.listdir(tmp_path / "r")) == ["checkpoints"]


def test_a_save_that_fails_stops_the_run_naming_the_steps_not_saved(tmp_path, monkeypatch):
  save = ocp.CheckpointManager.save

  def disk_full_at_step_4(manager, step, *args, **kwargs):
    if step == 4:
      raise OSError(28, "No space left on device")
    return save(manager, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full_at_step_4)
  with pytest.raises(CheckpointError) as raised:
    train.train(tiny_config(*CHECKPOINTED, "steps=6", f"base_output_directory={tmp_path}"))
  assert "checkpoint 4 could not be saved" in str(raised.value) and "steps after 2 are not saved" in str(raised.value)
  assert sorted(os.listdir(tmp_path / "default" / "checkpoints")) == ["2"]


def test_an_async_save_that_fails_is_one_line_naming_its_step(tmp_path, monkeypatch, capfd):
  """The background write of checkpoint 4 fails; the run learns it at the next save (6) or at its
  end, and must name 4, not the step it was at, without orbax's tracebacks from each thread."""
  write = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  async def disk_full_at_step_4(handler, item, directory):
    if os.path.basename(directory.parent).split(".")[0] == "4":
      raise OSError(28, "No space left on device")
    return await write(handler, item, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", disk_full_at_step_4)
  with pytest.raises(CheckpointError) as raised:
    train.train(tiny_config("enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=true",
                            "steps=6", f"base_output_directory={tmp_path}"))
  assert "checkpoint 4 could not be saved" in str(raised.value) and "steps after 2 are not saved" in str(raised.value)
  assert "Traceback" not in capfd.readouterr().err
  assert [name for name in os.listdir(tmp_path / "default" / "checkpoints") if name.isdigit()] == ["2"]


def test_a_checkpoints_directory_that_stops_taking_writes_stops_the_run_in_seconds(tmp_path, monkeypatch):
  """The checkpoints directory made immutable (chattr +i) after checkpoint 2, async saves: the run
  stops at checkpoint 4 within seconds, naming the OS error and the latest good checkpoint, where
  orbax's background directory creation would fail silently and its save wait 300 s."""
  save, immutable = checkpointing.save, []

  def immutable_before_4(manager, step, *args):
    if step == 4:
      checkpointing.wait_for_saves(manager)  # checkpoint 2 committed: the failure is 4's
      subprocess.run(["chattr", "+i", str(manager.directory)], check=True)
      immutable.append((str(manager.directory), time.monotonic()))
    return save(manager, step, *args)

  monkeypatch.setattr(checkpointing, "save", immutable_before_4)
  try:
    with pytest.raises(CheckpointError) as raised:
      train.train(tiny_config("enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=true",
                              "steps=6", f"base_output_directory={tmp_path}"))
  finally:
    for directory, _ in immutable:
      subprocess.run(["chattr", "-i", directory], check=True)
  assert time.monotonic() - immutable[0][1] < 30
  assert "checkpoint 4 could not be saved" in str(raised.value) and "Operation not permitted" in str(raised.value)
  assert "(latest checkpoint: 2)" in str(raised.value) and "\n" not in str(raised.value)
  assert [name for name in os.listdir(tmp_path / "default" / "checkpoints") if name.isdigit()] == ["2"]


def test_a_run_that_ends_inside_a_nonfinite_streak_says_so_and_saves_nothing_of_it(tmp_path, monkeypatch):
  device_batch, calls = train.device_batch, []

  def poisoned_last_two(trainer, batch):
    calls.append(1)
    if len(calls) >= 4:  # steps 4 and 5: token ids past the vocabulary make the loss NaN
      batch = {**batch, "inputs": np.full_like(batch["inputs"], 10**6)}
    return device_batch(trainer, batch)

  monkeypatch.setattr(train, "device_batch", poisoned_last_two)
  metrics_file = tmp_path / "new" / "folder" / "m.jsonl"  # its folder is made
  with pytest.raises(run_control.Diverged, match="steps 4-5 of 5: .* nothing after checkpoint 2 was saved"):
    train.train(tiny_config(*CHECKPOINTED, "steps=5", "max_nonfinite_steps=3", f"base_output_directory={tmp_path}",
                            f"metrics_file={metrics_file}"))
  assert sorted(os.listdir(tmp_path / "default" / "checkpoints")) == ["2"]
  assert [json.loads(line)["learning/nonfinite"] for line in metrics_file.read_text().splitlines()] == [0, 0, 0, 1, 1]


def test_train_writes_memory_stats_file_as_train_compile_does(tmp_path):
  stats_file = tmp_path / "stats" / "memory.json"
  train.train(tiny_config("steps=1", f"base_output_directory={tmp_path}", f"memory_stats_file={stats_file}"))
  stats = json.loads(stats_file.read_text())
  assert stats["fits"] is True and stats["total_bytes"] > 0 and stats["device_memory_bytes"] > stats["total_bytes"]


def test_a_bad_load_parameters_path_writes_nothing(tmp_path):
  error = train_error(f"base_output_directory={tmp_path}", "run_name=r",
                      f"load_parameters_path={tmp_path / 'no' / 'such' / 'checkpoint'}")
  assert error.exit_code == 2 and "load_parameters_path" in str(error)
  assert not (tmp_path / "r").exists()


def test_a_key_given_twice_keeps_its_last_value_auto_too():
  config = launch.config([BASE_YML, *TINY, "num_vocab_tiling=auto", "num_vocab_tiling=4"], plans=True)
  assert config.num_vocab_tiling == 4


def test_a_resume_on_fewer_devices_keeps_the_runs_global_batch(tmp_path, caplog):
  """A run with checkpoints, resumed with half its rows per step: two microbatches a step, said in
  one line; with microbatches that cannot make its batch up: one line naming the key."""
  run = tmp_path / "default"
  (run / "checkpoints" / "3").mkdir(parents=True)
  (run / "checkpoints" / "3" / checkpointing.COMMITTED).touch()
  run_control.record_run_files(tiny_config(f"base_output_directory={tmp_path}"), None)  # batches of 4 rows
  with caplog.at_level(logging.WARNING):
    kept = run_control.keep_global_batch(tiny_config(f"base_output_directory={tmp_path}", "per_device_batch_size=2"))
  assert kept.gradient_accumulation_steps == 2 and kept.global_batch_size_to_train_on == 4
  assert "trains on global batches of 4 rows: on 1 devices each step takes 2 microbatches of 2" in caplog.text
  with pytest.raises(errors.ConfigError, match=r"^per_device_batch_size=3: run .* trains on global batches of 4 "
                                               r"rows, which microbatches of 3 rows"):
    run_control.keep_global_batch(tiny_config(f"base_output_directory={tmp_path}", "per_device_batch_size=3"))
