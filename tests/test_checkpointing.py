"""Checkpoints: exact resume (stopped or SIGKILLed), atomic saves, clear errors, nothing lost."""

import asyncio
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from conftest import BASE_YML, ROOT, TINY, TINY_TEXT, run_cli, run_command

from MaxText import checkpointing, decode, errors, launch, pyconfig, run_control

# learning_rate_schedule_steps is pinned: otherwise a run stopped with steps=6 would follow a
# 6-step schedule, and no resume could match the 12-step run.
RUN = (*TINY, *TINY_TEXT, "enable_checkpointing=true", "checkpoint_period=2", "eval_interval=0",
       "learning_rate_schedule_steps=12", "log_period=100")


def losses(path):
  """{step: loss}, the last line written for each step (a resumed run rewrites some)."""
  return {r["step"]: r["learning/loss"] for r in map(json.loads, open(path).read().splitlines())}


def train(tmp_path, run_name, *args):
  metrics_file = tmp_path / f"{run_name}.jsonl"
  result = run_cli("train", *RUN, f"base_output_directory={tmp_path}", f"run_name={run_name}",
                   f"metrics_file={metrics_file}", *args)
  return result, metrics_file


def train_here(tmp_path, run_name, *args):
  """train's main in this process, for a test about what a resume trains rather than about the
  command's process: its metrics file (a UserError raises; the test's caplog holds its log)."""
  metrics_file = tmp_path / f"{run_name}.jsonl"
  run_command("train", *RUN, f"base_output_directory={tmp_path}", f"run_name={run_name}",
              f"metrics_file={metrics_file}", *args)
  return metrics_file


def tree_digest(path):
  digest = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      digest.update(os.path.relpath(os.path.join(root, name), path).encode())
      digest.update(open(os.path.join(root, name), "rb").read())
  return digest.hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_cache):
  """An uninterrupted 12-step run: (its output directory, its losses)."""
  tmp_path = tmp_path_factory.mktemp("reference")
  return tmp_path, losses(train_here(tmp_path, "ref", text_cache, "steps=12"))


def test_a_stopped_run_resumes_exactly(tmp_path, reference, text_cache, caplog):
  caplog.set_level("INFO")
  metrics_file = train_here(tmp_path, "stopped", text_cache, "steps=6")
  train_here(tmp_path, "stopped", text_cache, "steps=12")
  assert "resuming from checkpoint step 6" in caplog.text
  resumed = losses(metrics_file)
  assert sorted(resumed) == list(range(1, 13))
  assert resumed == reference[1]  # float equality, every step


@pytest.mark.slow
def test_a_mixture_of_experts_run_resumes_exactly(tmp_path, text_cache, caplog, capsys):
  """A stopped MoE run (router and experts in the checkpoint, the router's losses in the loss)
  resumes to the losses of an uninterrupted one, float equal, and decode continues a prompt from it."""
  caplog.set_level("INFO")
  moe = ("decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24", "steps=4")
  whole_metrics = train_here(tmp_path, "moe_whole", text_cache, *moe)
  metrics_file = train_here(tmp_path, "moe", text_cache, *moe[:-1], "steps=2")
  train_here(tmp_path, "moe", text_cache, *moe)
  assert "resuming from checkpoint step 2" in caplog.text
  assert losses(metrics_file) == losses(whole_metrics) and sorted(losses(metrics_file)) == [1, 2, 3, 4]
  capsys.readouterr()
  run_command("decode", *RUN, text_cache, *moe, f"base_output_directory={tmp_path}", "run_name=moe",
              "prompt=ROMEO:", "max_decode_length=6")
  decoded = capsys.readouterr().out
  assert decoded.startswith("ROMEO:") and len(decoded.strip()) > len("ROMEO:")


def signal_mid_run(tmp_path, text_cache, run_name, signum):
  """Starts a 12-step run, sends `signum` once 5 steps are logged: (exit code, stderr, metrics file)."""
  metrics_file = tmp_path / f"{run_name}.jsonl"
  args = [sys.executable, "-m", "MaxText.train", BASE_YML, *RUN, text_cache, "steps=12",
          f"base_output_directory={tmp_path}", f"run_name={run_name}", f"metrics_file={metrics_file}"]
  process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 5:
      break
    time.sleep(0.05)
  process.send_signal(signum)
  _, stderr = process.communicate(timeout=300)
  assert 5 <= len(metrics_file.read_text().splitlines()) < 12
  return process.returncode, stderr, metrics_file


def test_a_run_resumes_exactly_under_other_memory_settings(tmp_path, reference, text_cache, caplog):
  """Saved with the scanned stack, interval 1, remat full; resumed with a Python loop,
  interval 2, remat minimal and 4 vocabulary tiles: the same parameters, the same losses."""
  caplog.set_level("INFO")
  metrics_file = train_here(tmp_path, "switched", text_cache, "steps=6")
  train_here(tmp_path, "switched", text_cache, "steps=12", "scan_layers=false", "remat_layer_interval=2",
             "remat_policy=minimal", "num_vocab_tiling=4")
  assert "resuming from checkpoint step 6" in caplog.text
  resumed = losses(metrics_file)
  assert sorted(resumed) == list(range(1, 13))
  np.testing.assert_allclose([resumed[s] for s in range(7, 13)], [reference[1][s] for s in range(7, 13)], rtol=1e-5)


def test_a_sigkilled_run_resumes_exactly(tmp_path, reference, text_cache):
  signal_mid_run(tmp_path, text_cache, "killed", signal.SIGKILL)
  # The killed run left its lock behind; the rerun takes it over.
  assert (tmp_path / "killed" / ".lock").exists()
  result, metrics_file = train(tmp_path, "killed", text_cache, "steps=12")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "resuming from checkpoint step" in result.stderr and "stale lock" in result.stderr
  assert losses(metrics_file) == reference[1]
  assert not (tmp_path / "killed" / ".lock").exists()


def test_a_sigkilled_run_resumes_from_the_local_tier_past_the_persistent_checkpoint(tmp_path, reference, text_cache,
                                                                                   caplog):
  """enable_emergency_checkpoint with local_checkpoint_period=1, checkpoint_period=4: killed once
  the local tier holds step 5, the run resumes from its newest local step (5 or one after, not the
  persistent 4), data position included, to the uninterrupted run's losses."""
  emergency = ("checkpoint_period=4", "enable_emergency_checkpoint=true",
               f"local_checkpoint_directory={tmp_path / 'local'}", "local_checkpoint_period=1")
  metrics_file = tmp_path / "emergency.jsonl"
  process = subprocess.Popen([sys.executable, "-m", "MaxText.train", BASE_YML, *RUN, text_cache, *emergency,
                              "steps=12", f"base_output_directory={tmp_path}", "run_name=emergency",
                              f"metrics_file={metrics_file}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  local_5 = tmp_path / "local" / "emergency" / "5" / checkpointing.COMMITTED
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None and not local_5.exists():
    time.sleep(0.01)
  process.kill()
  _, stderr = process.communicate(timeout=60)
  assert local_5.exists(), stderr[-3000:]
  persistent = [int(d) for d in os.listdir(tmp_path / "emergency" / "checkpoints") if d.isdigit()]
  assert max(persistent) == 4
  caplog.set_level("INFO")
  train_here(tmp_path, "emergency", text_cache, *emergency, "steps=12")
  resumed = re.search(r"resuming from checkpoint step (\d+) in (\S+)", caplog.text)
  assert 5 <= int(resumed[1]) < 8 and resumed[2] == str(tmp_path / "local" / "emergency")
  assert losses(metrics_file) == reference[1]


def test_sigterm_saves_the_local_tier_first_then_the_persistent_one(tmp_path, text_cache, monkeypatch):
  """A SIGTERM after step 3 (between the persistent saves of 4 and the local ones of 2): both
  tiers save step 3, the local one first."""
  saved, save = [], checkpointing.save
  monkeypatch.setattr(checkpointing, "save", lambda manager, step, *args: (
      saved.append((os.path.basename(os.path.dirname(manager.directory)), step)), save(manager, step, *args)))
  monkeypatch.setattr(run_control, "stop_requested", lambda received, index: signal.SIGTERM if index == 2 else 0)
  with pytest.raises(run_control.Preempted, match="SIGTERM at step 3: checkpoint 3 saved"):
    train_here(tmp_path, "stopped", text_cache, "steps=12", "checkpoint_period=4", "enable_emergency_checkpoint=true",
               f"local_checkpoint_directory={tmp_path / 'local'}", "local_checkpoint_period=2")
  assert saved == [("local", 2), ("local", 3), ("stopped", 3)]


def test_a_local_tier_that_cannot_be_kept_is_one_line_naming_its_key(tmp_path):
  base = ("enable_emergency_checkpoint=true", "checkpoint_period=4", f"base_output_directory={tmp_path}")
  (tmp_path / "file").write_text("")
  for overrides, key in [(("local_checkpoint_period=1",), "local_checkpoint_directory"),
                         ((f"local_checkpoint_directory={tmp_path}/l", "local_checkpoint_period=8"),
                          "local_checkpoint_period"),
                         (("local_checkpoint_directory=gs://bucket/l", "local_checkpoint_period=1"),
                          "local_checkpoint_directory"),
                         ((f"local_checkpoint_directory={tmp_path}/file", "local_checkpoint_period=1"),
                          "local_checkpoint_directory")]:
    with pytest.raises(errors.ConfigError, match=f"^{key}[=:]"):
      run_command("train", *RUN, *base, *overrides)
  assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.parametrize("signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_a_preempted_run_saves_its_last_step_and_resumes_exactly(tmp_path, reference, text_cache, signum, name):
  code, stderr, metrics_file = signal_mid_run(tmp_path, text_cache, "preempted", signum)
  assert code == 128 + signum and "Traceback" not in stderr, stderr[-3000:]
  last_line = stderr.strip().splitlines()[-1]
  stopped_at = len(metrics_file.read_text().splitlines())
  assert last_line == f"stopped: {name} at step {stopped_at}: checkpoint {stopped_at} saved; rerun to resume"
  assert (tmp_path / "preempted" / "checkpoints" / str(stopped_at)).is_dir()
  result, _ = train(tmp_path, "preempted", text_cache, "steps=12")
  assert result.returncode == 0 and f"resuming from checkpoint step {stopped_at}" in result.stderr
  assert losses(metrics_file) == reference[1]


def test_divergence_stops_the_run_and_keeps_every_good_checkpoint(tmp_path, reference, text_cache):
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  before = tree_digest(run / "checkpoints")
  result, metrics_file = train(tmp_path, "ref", text_cache, "steps=20", "learning_rate_schedule_steps=20",
                               "learning_rate=1e30")
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last_line = result.stderr.strip().splitlines()[-1]
  assert last_line.startswith("error: step ") and "not finite for 3 steps in a row" in last_line
  rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
  assert [r["learning/nonfinite"] for r in rows][-3:] == [1.0, 1.0, 1.0] and rows[-1]["step"] < 20
  assert tree_digest(run / "checkpoints") == before  # nothing saved, nothing pruned
  assert not (run / ".lock").exists()


def test_a_second_process_on_the_same_run_is_refused(tmp_path, text_cache):
  (tmp_path / "busy").mkdir()
  # A live process of this program (its command line names MaxText), as a training run would be.
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "MaxText"])
  try:
    (tmp_path / "busy" / ".lock").write_text(str(holder.pid))
    result, _ = train(tmp_path, "busy", text_cache, "steps=2")
  finally:
    holder.kill()
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
  assert f"being trained by process {holder.pid}" in result.stderr
  assert os.listdir(tmp_path / "busy") == [".lock"]


def test_a_stale_lock_is_taken_over_saying_why_and_one_that_is_a_directory_is_named(tmp_path, caplog):
  from MaxText import run_control
  unrelated = subprocess.Popen(["sleep", "300"])  # alive, but not this program: a reused pid
  while not Path(f"/proc/{unrelated.pid}/cmdline").read_bytes():  # forked, not yet sleep
    time.sleep(0.01)
  dead = subprocess.Popen(["true"])
  dead.wait()
  try:
    for holder, why in [(unrelated.pid, f"pid {unrelated.pid} is now sleep, not MaxText"),
                        (dead.pid, f"process {dead.pid} is no longer running"), ("", "it holds '', not a pid"),
                        ("garbage", "it holds 'garbage', not a pid")]:
      (tmp_path / ".lock").write_text(str(holder))
      caplog.clear()
      with run_control.run_lock(str(tmp_path)):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
      assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
          f"taking over the stale lock {tmp_path / '.lock'}: {why}"]
  finally:
    unrelated.kill()
  assert not (tmp_path / ".lock").exists()
  (tmp_path / ".lock").mkdir()
  with pytest.raises(errors.ConfigError, match=re.escape(f"run_name: {tmp_path / '.lock'} is in the way")):
    with run_control.run_lock(str(tmp_path)):
      pass
  assert (tmp_path / ".lock").is_dir()


def test_a_save_killed_midway_is_never_restored(tmp_path, reference, text_cache):
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  checkpoints = run / "checkpoints"
  shutil.rmtree(checkpoints / "12")
  # What a kill leaves behind: step 12 written halfway into orbax's temporary directory.
  partial = checkpoints / "12.orbax-checkpoint-tmp"
  shutil.copytree(checkpoints / "10", partial)
  for root, _, files in os.walk(partial / "state"):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(root, name)) // 2)
  metrics_file = tmp_path / "ref.jsonl"
  result = run_cli("train", *RUN, text_cache, "steps=12", f"base_output_directory={tmp_path}",
                   "run_name=ref", f"metrics_file={metrics_file}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "resuming from checkpoint step 10" in result.stderr
  assert not partial.exists() and (checkpoints / "12").is_dir()
  assert losses(metrics_file) == {s: reference[1][s] for s in (11, 12)}


def damage(step_dir, how):
  """Overwrites every array file with garbage, flips a byte in each data file (every array
  unreadable, the metadata intact), flips one bit in the largest one (what tensorstore restores
  without a word), or removes the parameters item, leaving nothing or a file in its place."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.name != "_CHECKPOINT_METADATA"]
  if how in ("no state", "state a file"):
    shutil.rmtree(step_dir / "state")
    if how == "state a file":
      (step_dir / "state").write_text("garbage")
  elif how == "garbage":
    for path in files:
      path.write_bytes(b"garbage")
  elif how == "unreadable data":
    for path in (p for p in files if p.parent.name == "d"):
      data = bytearray(path.read_bytes())
      data[len(data) // 2] ^= 0xFF
      path.write_bytes(data)
  else:
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x10
    largest.write_bytes(data)


def test_reads_that_fail_after_orbax_closed_its_event_loop_print_no_traceback(caplog):
  """Which abandoned reads fail before a restore gives up is a race: here two fail, the first is
  raised, and the second's task, never awaited, is collected after its loop closed. Only the
  loops made inside a restore are quieted, and only once closed."""

  async def read():
    raise ValueError("DATA_LOSS")

  async def restore():
    reads = [asyncio.ensure_future(read()) for _ in range(2)]  # held until the restore ends, as orbax holds them
    await asyncio.sleep(0)  # both fail; the restore raises the first and abandons the second
    await reads[0]

  def fail_on(loop, close):
    with pytest.raises(ValueError):
      loop.run_until_complete(restore())
    if close:
      loop.close()
    gc.collect()

  with checkpointing._abandoned_reads_quiet():
    restore_loop, open_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
  fail_on(restore_loop, close=True)
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
  fail_on(open_loop, close=False)  # an open loop still reports it
  assert any("never retrieved" in r.getMessage() for r in caplog.records)
  open_loop.close()
  caplog.clear()
  fail_on(asyncio.new_event_loop(), close=True)  # a loop made outside a restore is asyncio's own
  assert any("never retrieved" in r.getMessage() for r in caplog.records)


def test_exceptions_through_orbax_reach_the_debug_log_only_and_others_are_kept():
  """An abandoned read's exception, reported by asyncio from whatever loop ran it, or orbax's own
  traceback of a failed save: the command says it in one line; other libraries' are printed."""
  from absl import logging as absl_logging
  from etils import epath
  checkpointing.quiet_orbax_tracebacks()  # as every save and restore does
  try:
    ocp.PyTreeCheckpointHandler().metadata(epath.Path("/no/such/checkpoint/state"))
  except Exception as e:  # whatever orbax raises
    through_orbax = e
  try:
    raise ValueError("not from orbax")
  except ValueError as e:
    elsewhere = e
  message = "Task exception was never retrieved"
  never_retrieved = [logging.LogRecord("asyncio", logging.ERROR, asyncio.__file__, 1, message, None,
                                       (type(e), e, e.__traceback__)) for e in (through_orbax, elsewhere)]
  assert [bool(absl_logging.get_absl_handler().filter(r)) for r in never_retrieved] == [False, True]


@pytest.mark.parametrize("how, why", [("garbage", "cannot be restored"), ("unreadable data", "cannot be restored"),
                                      ("flipped bit", "differ from their checksums"),
                                      ("no state", "cannot be restored"), ("state a file", "cannot be restored")])
def test_a_damaged_checkpoint_is_set_aside_whole_and_the_run_resumes_from_the_one_before(
    tmp_path, reference, text_cache, how, why):
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  damage(run / "checkpoints" / "12", how)
  damaged = tree_digest(run / "checkpoints" / "12")
  result, metrics_file = train(tmp_path, "ref", text_cache, "steps=12")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Traceback" not in result.stderr  # nor the reads orbax abandoned calling into its closed event loop
  warning = next(line for line in result.stderr.splitlines() if "is damaged" in line)
  assert "checkpoints/12" in warning and why in warning and "resuming from step 10" in warning
  assert tree_digest(run / "damaged_checkpoints" / "12") == damaged
  assert losses(metrics_file) == {s: reference[1][s] for s in (11, 12)}
  assert tree_digest(run / "checkpoints" / "12") != damaged  # step 12 saved again, from good state


def test_when_no_checkpoint_is_good_the_run_stops_with_one_line_and_moves_nothing(tmp_path, reference, text_cache):
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  for step in os.listdir(run / "checkpoints"):
    damage(run / "checkpoints" / step, "flipped bit")
  before = tree_digest(run / "checkpoints")
  result, _ = train(tmp_path, "ref", text_cache, "steps=14", "learning_rate_schedule_steps=14")
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert "Traceback" not in result.stderr and lines[-1].startswith("error: no checkpoint in")
  assert all(f"step {step}: 1 of" in lines[-1] for step in (8, 10, 12)), lines[-1]
  assert tree_digest(run / "checkpoints") == before and not (run / "damaged_checkpoints").exists()


@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16])
def test_checksums_taken_a_slice_at_a_time_are_the_whole_arrays(dtype):
  """The converters checksum a parameter a layer at a time; the sums wrap (uint32) and the
  position weights continue across slices, so the result is checksums() of the whole array,
  and a slice fed out of order is not."""
  x = np.random.default_rng(0).standard_normal((5, 7, 33)).astype(dtype)
  whole = checkpointing.checksums({"x": x})["['x']"]
  running = checkpointing.SliceChecksums()
  for k in range(x.shape[0]):
    running.add(x[k])
  assert running.value() == whole
  swapped = checkpointing.SliceChecksums()
  for k in [1, 0, 2, 3, 4]:
    swapped.add(x[k])
  assert swapped.value()[0] == whole[0] and swapped.value()[1] != whole[1]


def test_parameters_that_differ_from_their_checksums_are_refused(tmp_path, reference, text_cache):
  """load_parameters_path reads the parameters only: a recorded parameter checksum off by one
  stands for a flipped bit in that parameter (the bit flipped above lands in the optimizer state)."""
  damaged = tmp_path / "12"
  shutil.copytree(reference[0] / "ref" / "checkpoints" / "12", damaged)
  recorded = json.loads((damaged / "checksums" / "metadata").read_text())
  key = next(k for k in recorded if k.startswith(".params") and k.endswith("['kernel']"))
  recorded[key][0] = (recorded[key][0] + 1) % 2**32
  (damaged / "checksums" / "metadata").write_text(json.dumps(recorded))
  result, _ = train(tmp_path, "new", text_cache, "steps=1", f"load_parameters_path={damaged}")
  assert result.returncode == 1
  line = result.stderr.strip().splitlines()[-1]
  assert line.startswith(f"error: load_parameters_path='{damaged}': 1 of") and key.removeprefix(".params") in line
  assert not (tmp_path / "new" / "checkpoints").exists()  # the new run's: nothing written before the line


@pytest.mark.parametrize("bad", ["dataset_path={tmp}/missing", "dataset_path={tmp}/empty.txt",
                                 "tokenizer_path={tmp}/broken.json"])
def test_bad_data_inputs_stop_with_one_line_and_lose_nothing(tmp_path, reference, text_cache, bad):
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "broken.json").write_text("{")
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  before = tree_digest(run)
  bad = bad.format(tmp=tmp_path)
  result, _ = train(tmp_path, "ref", text_cache, "steps=14", "learning_rate_schedule_steps=14", bad)
  assert result.returncode == 2, result.stderr[-2000:]
  assert len(result.stderr.strip().splitlines()) == 1 and bad.split("/")[-1] in result.stderr
  assert tree_digest(run) == before


def test_max_to_keep_keeps_the_newest_checkpoints(reference):
  assert sorted(os.listdir(reference[0] / "ref" / "checkpoints")) == ["10", "12", "8"]


def test_a_finished_run_rerun_trains_nothing_and_keeps_its_checkpoints(tmp_path, reference, text_cache):
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  before = tree_digest(run / "checkpoints")
  result, metrics_file = train(tmp_path, "ref", text_cache, "steps=12")
  assert result.returncode == 0 and "nothing to train" in result.stderr
  assert metrics_file.read_text() == "" and tree_digest(run / "checkpoints") == before


def test_load_parameters_path_starts_a_new_run_from_trained_parameters(tmp_path, reference, text_cache):
  source = reference[0] / "ref" / "checkpoints" / "12"
  result, metrics_file = train(tmp_path, "finetune", text_cache, "steps=1", f"load_parameters_path={source}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "parameters loaded from" in result.stderr
  loss = losses(metrics_file)
  assert list(loss) == [1] and loss[1] < reference[1][1] - 0.5
  missing, _ = train(tmp_path, "finetune2", text_cache, "steps=1", f"load_parameters_path={tmp_path}/nope")
  assert missing.returncode == 2 and "load_parameters_path" in missing.stderr
  with pytest.raises(errors.ConfigError, match=r"has shape \(2, 32, 64\), this config.s model \(3, 32, 64\)"):
    run_command("train", *RUN, text_cache, f"base_output_directory={tmp_path}", "run_name=deeper",
                "base_num_decoder_layers=3", f"load_parameters_path={source}")
  assert not (tmp_path / "deeper").exists()  # another model's parameters: refused before the run directory is made
  # Into a run that already has checkpoints it would be silently ignored: refused instead.
  again, _ = train(tmp_path, "finetune", text_cache, "steps=2", f"load_parameters_path={source}")
  assert again.returncode == 2 and "already has checkpoints" in again.stderr.strip().splitlines()[-1]


def test_decode_continues_the_prompt(reference, text_cache, capsys):
  args = (*RUN, text_cache, f"base_output_directory={reference[0]}", "run_name=ref", "prompt=ROMEO:",
          "max_decode_length=8")

  def decoded(*more):
    run_command("decode", *args, *more)
    return capsys.readouterr().out

  first = decoded()
  assert first.startswith("ROMEO:") and len(first.strip()) > len("ROMEO:")
  assert decoded() == first
  # The run's own tokenizer.json decodes: the data flags are not even read.
  assert decoded("dataset_path=/no/such/corpus") == first
  with pytest.raises(errors.ConfigError, match="prompt='': give some text"):
    decoded("prompt=")


def test_the_run_keeps_its_config_and_tokenizer_and_a_resume_may_not_change_the_tokenizer(tmp_path, reference,
                                                                                         text_cache):
  run = reference[0] / "ref"
  config = yaml.safe_load((run / "config.yml").read_text())
  assert config["run_name"] == "ref" and config["vocab_size"] == 320 and config["steps"] == 12
  assert json.loads((run / "tokenizer.json").read_text())["model"]["type"] == "BPE"
  shutil.copytree(run, tmp_path / "ref")
  before = tree_digest(tmp_path / "ref" / "checkpoints")
  config_yml = (tmp_path / "ref" / "config.yml").read_text()
  result, _ = train(tmp_path, "ref", text_cache, "steps=14", "learning_rate_schedule_steps=14", "tokenizer_type=byte",
                    f"dataset_cache_dir={tmp_path / 'cache'}")
  assert result.returncode == 2 and "tokenizer other than the one run" in result.stderr
  assert (tmp_path / "ref" / "config.yml").read_text() == config_yml
  assert not (tmp_path / "cache").exists()  # the refused start's tokens are not cached
  assert len(result.stderr.strip().splitlines()) == 1
  assert tree_digest(tmp_path / "ref" / "checkpoints") == before


@pytest.mark.parametrize("key, where", [
    ("base_output_directory", "{file}/outputs"), ("dataset_cache_dir", "{file}/cache"),
    ("metrics_file", "{file}/m.jsonl"), ("metrics_file", "{dir}"), ("base_output_directory", "gs://bucket/runs"),
])
def test_a_path_that_cannot_be_written_stops_the_run_before_it_writes(tmp_path, key, where):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  out = tmp_path / "out"
  args = [f"base_output_directory={out}", f"{key}={where.format(file=a_file, dir=tmp_path)}"]
  with pytest.raises(errors.ConfigError, match=key) as error:
    run_command("train", *TINY, *dict.fromkeys(args))  # key may repeat base_output_directory: the last wins
  assert "\n" not in str(error.value)
  assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_checkpoint_without_checksums_is_refused_unless_trusted(tmp_path, reference, text_cache):
  """Every checkpoint the project writes has checksums: one without them (removed, or from
  elsewhere) is refused by every reader, with one line naming it and the flag."""
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  step = run / "checkpoints" / "12"
  shutil.rmtree(step / "checksums")
  before = tree_digest(run / "checkpoints")
  refusal = (f"checkpoint {step} has no checksums, so damage to it cannot be detected; set "
             "trust_unverified_checkpoints=true")
  result, _ = train(tmp_path, "ref", text_cache, "steps=12")
  last_line = result.stderr.strip().splitlines()[-1]
  assert result.returncode == 2 and last_line == f"config error: {refusal} to use it anyway"
  assert "Traceback" not in result.stderr and tree_digest(run / "checkpoints") == before
  # load_parameters_path (train, decode, to_huggingface) is refused before anything is written; decode of the run too
  with pytest.raises(errors.ConfigError, match=re.escape(refusal)):
    launch.config([BASE_YML, *RUN, text_cache, f"load_parameters_path={step}"])
  with pytest.raises(errors.ConfigError, match=re.escape(refusal)):
    decode.generate(pyconfig.initialize([BASE_YML, *RUN, text_cache, f"base_output_directory={tmp_path}",
                                         "run_name=ref"]))
  trusted, _ = train(tmp_path, "ref", text_cache, "steps=12", "trust_unverified_checkpoints=true")
  assert trusted.returncode == 0 and "restored unverified" in trusted.stderr, trusted.stderr[-3000:]


@pytest.mark.parametrize("key, value, trained", [("base_emb_dim", 64, 32),  # other shapes
                                                 ("rope_max_timescale", 500000, 10000)])  # the same shapes
def test_a_resume_with_other_model_keys_is_one_line_naming_the_key_and_changes_nothing(tmp_path, reference, text_cache,
                                                                                       key, value, trained):
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  before = tree_digest(run)
  result, _ = train(tmp_path, "ref", text_cache, "steps=14", "learning_rate_schedule_steps=14", f"{key}={value}")
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert lines[-1].startswith(f"config error: {key}={value}: run {run} was trained with {key}={trained},"), lines[-1]
  assert tree_digest(run) == before  # config.yml included: a later load_parameters_path still reads the run's model


def test_decode_skips_a_stray_step_directory_and_refuses_destroyed_parameters(tmp_path, reference, text_cache):
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  (run / "checkpoints" / "99").mkdir()  # what training would set aside: orbax never committed it
  config = pyconfig.initialize([BASE_YML, *RUN, text_cache, f"base_output_directory={tmp_path}", "run_name=ref",
                                "prompt=ROMEO:", "max_decode_length=4"])
  assert checkpointing.latest_checkpoint(config) == str(run / "checkpoints" / "12")
  assert decode.generate(config).startswith("ROMEO:")
  # Every array zero (what missing chunks read as), its checksums gone and the user trusting it anyway
  zeroed = jax.tree.map(np.zeros_like, checkpointing.load_model_parameters(config, str(run / "checkpoints" / "12")))
  with pytest.raises(checkpointing.CheckpointError, match="parameters are all zero or not finite"):
    decode._check_not_destroyed(zeroed, "checkpoints/12")


def test_decode_says_when_the_model_gives_one_token_from_the_first_step(tmp_path, reference, text_cache, caplog):
  """Parameters damaged but finite and not zero (every array one constant: each token's logit
  the same) continue with token 0 from a flat distribution at every step: decode says so; the
  trained ones do not draw the warning."""
  config = pyconfig.initialize([BASE_YML, *RUN, text_cache, f"base_output_directory={reference[0]}",
                                "run_name=ref", "max_decode_length=6"])
  params = checkpointing.load_model_parameters(config, checkpointing.latest_checkpoint(config))
  with caplog.at_level(logging.WARNING):
    decode.continuation(config, params, [5, 6, 7])
  assert "decode: the model gives" not in caplog.text
  constant = jax.tree.map(lambda p: np.full_like(p, 0.02), params)
  with caplog.at_level(logging.WARNING):
    assert decode.continuation(config, constant, [5, 6, 7]) == [0] * 6
  assert f"token 0 at every step from a flat distribution (every token's probability 1/{config.vocab_size})" in \
      caplog.text


@pytest.mark.parametrize("tokens, chosen, spreads, said", [
    ([3, 3, 3], [0.999, 0.995, 0.999], [0.9, 0.9, 0.9], "token 3 at every step with probability at least 0.995"),
    ([3, 3, 3], [0.9, 0.995, 0.999], [0.9, 0.9, 0.9], None),  # sure only at times
    ([3, 4, 3], [1.0, 1.0, 1.0], [0.9, 0.9, 0.9], None)])
def test_a_degenerate_continuation_is_one_token_certain_or_flat_at_every_step(tokens, chosen, spreads, said):
  assert decode.degenerate(tokens, chosen, spreads, 100) == said


def test_decode_of_another_runs_checkpoint_uses_that_runs_tokenizer(tmp_path, reference, text_cache):
  prompt = ("prompt=ROMEO:", "max_decode_length=4")
  own = pyconfig.initialize([BASE_YML, *RUN, text_cache, f"base_output_directory={reference[0]}", "run_name=ref",
                             *prompt])
  # The flags name the byte tokenizer; the parameters were trained with the run's BPE.
  elsewhere = pyconfig.initialize([BASE_YML, *RUN, text_cache, f"base_output_directory={tmp_path}", "run_name=other",
                                   "tokenizer_type=byte", *prompt,
                                   f"load_parameters_path={reference[0] / 'ref' / 'checkpoints' / '12'}"])
  assert decode.generate(elsewhere) == decode.generate(own)


def test_a_garbage_run_tokenizer_is_one_line_for_train_and_decode(tmp_path, reference, text_cache):
  from MaxText import run_control
  from MaxText.input_pipeline import tokenizer
  run = tmp_path / "ref"
  shutil.copytree(reference[0] / "ref", run)
  (run / "tokenizer.json").write_text("{not a tokenizer")
  config = pyconfig.initialize([BASE_YML, *RUN, text_cache, f"base_output_directory={tmp_path}", "run_name=ref"])
  message = re.escape(f"{run / 'tokenizer.json'}, the tokenizer ") + ".*cannot load a tokenizer.json"
  with pytest.raises(errors.ConfigError, match=message):
    run_control.check_resume(config, tokenizer.byte_tokenizer(), trained=True)
  with pytest.raises(errors.ConfigError, match=message):
    decode.generate(config)
  assert (run / "tokenizer.json").read_text() == "{not a tokenizer"


def test_checksums_need_no_temporary_the_size_of_the_array():
  """A bfloat16 parameter's checksums compile to one fused pass (converters and saves hold a
  parameter at a time; its uint32 bits and weights materialised would be 4 times its size)."""
  array = jax.ShapeDtypeStruct((4096, 1024), jax.numpy.bfloat16)
  stats = checkpointing._tree_checksums.lower({"a": array}).compile().memory_analysis()
  assert stats.temp_size_in_bytes < array.size * array.dtype.itemsize / 8
