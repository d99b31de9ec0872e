"""Pipeline stages on 8 simulated devices give one device's loss and gradients (GPipe, circular
and 1F1B; dense, Gemma 2, a mixture of experts, Llama 4 routing every other layer and GPT-OSS);
1F1B's memory does not grow with the microbatches; a run saved pipelined resumes without a
pipeline; the schedule's bubble; bad pipeline settings are one-line config errors."""

import contextlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  SHARDED,
  assert_trees_close,
  fixed_batch,
  metrics_losses,
  on_devices,
  tiny_config,
  trainer_and_params,
  trainer_and_state,
  with_slow_decays,
)

from MaxText import costs, errors, hlo_network, plan, pyconfig, sharding, train, train_step
from MaxText.layers import pipeline

MODELS = {
    "llama": ("base_num_decoder_layers=4",),
    # Windows on every other layer: a stage that ran its layers under another layer's index would
    # attend with the wrong window.
    "gemma2": ("base_num_decoder_layers=4", "decoder_block=gemma2", "logits_via_embedding=true",
               "sliding_window_size=6", "attn_logits_soft_cap=50.0", "final_logits_soft_cap=30.0"),
    # DeepSeek-V3's layout: a dense first layer (before the stages, on every device), then 4 MoE
    # layers with sigmoid scores, a correction bias whose loads the step reports, and a shared
    # expert; after the stages a multi-token prediction layer (an MoE layer too).
    "moe": ("base_num_decoder_layers=5", "first_num_dense_layers=1", "decoder_block=qwen3_moe", "num_experts=4",
            "num_experts_per_tok=2", "base_moe_mlp_dim=24", "load_balance_loss_weight=0.1",
            "router_z_loss_weight=0.01", "routed_score_func=sigmoid", "routed_bias=true", "shared_experts=1",
            "mtp_num_layers=1", "mtp_loss_scaling_factor=0.3"),
    # Llama 4, every other layer routed: stages of whole blocks (a dense layer and a routed one),
    # the routed layers' loads reported in the block's stored layout; its chunks, NoPE layer 3 with
    # temperature tuning and unit-RMS queries and keys, each at its layer's index within its stage.
    "interleaved": ("base_num_decoder_layers=4", "interleave_moe_layer_step=2", "decoder_block=llama4",
                    "num_experts=4", "num_experts_per_tok=1", "base_moe_mlp_dim=24", "shared_experts=1",
                    "load_balance_loss_weight=0.1", "routed_score_func=sigmoid", "routed_bias=true",
                    "nope_layer_interval=4", "chunk_attn_window_size=4", "temperature_tuning=true",
                    "temperature_tuning_floor=2", "use_qk_norm=true"),
    # GPT-OSS: sliding and full layers alternating across the stages, sinks (zero at first, each
    # still a term of every softmax), biased attention and experts, the clamped gated unit.
    "gpt_oss": ("base_num_decoder_layers=4", "decoder_block=gpt_oss", "num_experts=4", "num_experts_per_tok=2",
                "base_moe_mlp_dim=32", "sliding_window_size=6", "attention_bias=true", "attention_sink=true",
                "mlp_bias=true", "mlp_activations_limit=1.5", "load_balance_loss_weight=0.1"),
    # Qwen3-Next: a Gated DeltaNet layer and a gated attention layer a block, a block a stage; its
    # norms' epsilon large, so the output norm of a head whose output is near zero multiplies
    # float32 rounding less (conftest.with_slow_decays).
    "qwen3_next": ("base_num_decoder_layers=4", "decoder_block=qwen3_next", "inhomogeneous_layer_cycle_interval=2",
                   "normalization_layer_epsilon=1e-3",
                   "head_dim=8", "partial_rotary_factor=0.25", "gdn_num_key_heads=4", "gdn_num_value_heads=8",
                   "gdn_key_head_dim=8", "gdn_value_head_dim=8", "gdn_chunk_size=4", "num_experts=4",
                   "num_experts_per_tok=2", "base_moe_mlp_dim=32", "shared_experts=1",
                   "load_balance_loss_weight=0.1"),
}
# The one-device reference: the same batch as 4 accumulated microbatches, as the pipelines' terms
# (the router's losses, multi-token prediction's) are each microbatch's; for a model without them
# it is the whole batch's step.
REFERENCE = ("gradient_accumulation_steps=4", "per_device_batch_size=4")
# Models whose tests start from parameters of their own (conftest.with_slow_decays), not from an
# initialisation on the pipeline mesh.
SLOW_DECAYS = ("qwen3_next",)
_PP2, _PP4 = "ici_pipeline_parallelism=2", "ici_pipeline_parallelism=4"
CASES = {  # name -> (model, overrides on 8 devices, 2 rows per device)
    "gpipe pp2 fsdp2 data2 m4": ("llama", (_PP2, "ici_fsdp_parallelism=2", "ici_data_parallelism=2",
                                           "num_pipeline_microbatches=4", "pipeline_schedule=gpipe")),
    "circular pp2 r2 fsdp4 m2": ("gemma2", (_PP2, "ici_fsdp_parallelism=4", "num_pipeline_repeats=2")),
    "1f1b pp4 tensor2 m16": ("gemma2", (_PP4, "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1",
                                        "pipeline_schedule=1f1b", "num_pipeline_microbatches=16")),
    "1f1b pp2 context2 fsdp2 m4, accumulation 2, 4 tiles, interval 2": (
        "llama", (_PP2, "ici_fsdp_parallelism=2", "ici_context_parallelism=2", "pipeline_schedule=1f1b",
                  "num_pipeline_microbatches=4", "attention=chunked", "attention_chunk_size=4",
                  "gradient_accumulation_steps=2", "per_device_batch_size=1", "num_vocab_tiling=4",
                  "remat_layer_interval=2")),
    # Circular: the loads that move the correction bias are in the stages' order of the layers.
    "moe circular pp2 r2 expert2 tensor2 m4": ("moe", (_PP2, "ici_expert_parallelism=2", "ici_tensor_parallelism=2",
                                                       "ici_fsdp_parallelism=1", "num_pipeline_microbatches=4",
                                                       "num_pipeline_repeats=2")),
    "interleaved gpipe pp2 expert2 fsdp2 m4": (
        "interleaved", (_PP2, "ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=4",
                        "pipeline_schedule=gpipe")),
    # Interleaved 1F1B: two repeats, the microbatches in groups of the stages' count.
    "moe 1f1b pp2 r2 fsdp4 m4": ("moe", (_PP2, "ici_fsdp_parallelism=4", "pipeline_schedule=1f1b",
                                         "num_pipeline_repeats=2", "num_pipeline_microbatches=4")),
    # Each stage keeps what its forwards saved (pipeline_keep_residuals): sinks, biases and routing.
    "gpt_oss 1f1b pp2 tensor2 fsdp2 m4, residuals kept": (
        "gpt_oss", (_PP2, "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2", "pipeline_schedule=1f1b",
                    "num_pipeline_microbatches=4", "pipeline_keep_residuals=true")),
    "qwen3_next gpipe pp2 tensor2 fsdp2 m4": ("qwen3_next", (_PP2, "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2",
                                                             "num_pipeline_microbatches=4", "pipeline_schedule=gpipe")),
}


# Each model's first case initialises its parameters on its pipeline mesh, and so shows that
# initialisation gives one device's parameters (the stored layers are the same whatever the
# stages); its other cases start from one device's parameters, no initialisation compiled.
INITIALISED = {next(case for case, (model, _) in CASES.items() if model == name) for name in MODELS
               if name not in SLOW_DECAYS}


def step_gradients(config, batch, params=None):
  """{"loss": summed loss, the step's sums (the router's statistics and loads included), parameter
  path: gradient per scored token}, the loads and gradients in layer order, of the train step's own gradients
  (train_step.gradients: the 1F1B loop where the config asks for it), gathered, at config's
  initial parameters (or at `params`, laid out on config's mesh)."""
  trainer, params = trainer_and_params(config, params)
  with sharding.activate(trainer.mesh, config):
    (loss, sums), grads = jax.jit(lambda p, b: train_step.gradients(trainer.model, config, p, b))(
        params, train_step.device_batch(trainer, batch))
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(trainer.relayout((sums, grads), False)))
  return {"loss": np.asarray(loss), **{jax.tree_util.keystr(path): np.asarray(g) for path, g in leaves}}


@pytest.fixture(scope="module")
def one_device():
  """{model: (its batch of 16 rows, its initial parameters and its loss and gradients on one
  device, no pipeline, accumulating 4 microbatches)}."""
  results = {}
  for name, model in MODELS.items():
    config = tiny_config(*SHARDED, *model, *REFERENCE)
    batch, params = fixed_batch(config), jax.device_get(trainer_and_state(config)[1].params)
    params = with_slow_decays(params) if name in SLOW_DECAYS else params
    results[name] = batch, params, step_gradients(config, batch, params)
  return results


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_gradients_equal_one_device(one_device, case):
  model, overrides = CASES[case]
  batch, params, want = one_device[model]
  with on_devices(8):
    config = tiny_config(*SHARDED, *MODELS[model], "per_device_batch_size=2", *overrides)
    got = step_gradients(config, batch, None if case in INITIALISED else params)
  assert config.pipeline_stages > 1
  assert_trees_close(got, want, rtol=1e-5, what=case)


def _temp_bytes(*overrides):
  with on_devices(8):
    config = tiny_config("base_emb_dim=64", "base_mlp_dim=128", "base_num_decoder_layers=4",
                         "max_target_length=64", "vocab_size=256", "remat_policy=full", _PP2, "ici_fsdp_parallelism=4",
                         *overrides)
    compiled = train_step.compile_train_step(train_step.build(config, sharding.create_mesh(config)), config)
  return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_memory_does_not_grow_with_the_microbatches():
  """Microbatches of the same size (one row per batch shard), 4 then 16 of them, on XLA:CPU:
  1F1B keeps at most 2S - 1 microbatches' residuals, GPipe every one until its backward."""
  temp = {(schedule, count): _temp_bytes(f"pipeline_schedule={schedule}", f"num_pipeline_microbatches={count}",
                                         f"per_device_batch_size={count / 2:g}")
          for schedule, count in (("1f1b", 4), ("1f1b", 16), ("gpipe", 16))}
  assert temp["1f1b", 16] <= 1.25 * temp["1f1b", 4], temp
  assert temp["1f1b", 16] < temp["gpipe", 16] / 2, temp


def test_only_activations_cross_between_circular_stages():
  """Compiled on XLA:CPU, 2 stages x fsdp 4, 2 microbatches, layers whose MLP holds most of their
  weights: what a step sends over the pipeline axis with 2 repeats exceeds what it sends with 1
  by less than one layer's weights on a device. A stage's stored shard holds the layers it runs,
  so no weight moves between stages; the repeats add activations only."""
  sent = {}
  with on_devices(8):
    for repeats in (1, 2):
      config = tiny_config(*SHARDED, "base_num_decoder_layers=4", "base_mlp_dim=1024", "per_device_batch_size=1", _PP2,
                           "ici_fsdp_parallelism=4", "pipeline_schedule=gpipe", f"num_pipeline_repeats={repeats}")
      trainer = train_step.build(config, sharding.create_mesh(config))
      hlo = train_step.compile_train_step(trainer, config).as_text()
      sent[repeats] = hlo_network.network_bytes(hlo, trainer.mesh)["by_axes"]["pipeline"]["ici"]
  layers = trainer.abstract_state.params["decoder"]["layers"]
  layer = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(layers)) / config.base_num_decoder_layers
  assert 0 < sent[2] - sent[1] < layer / config.ici_fsdp_parallelism, sent


@pytest.mark.parametrize("count", [2, 4])
def test_interleaved_1f1b_sends_only_what_the_next_phase_reads(count):
  """Compiled on XLA:CPU, 2 stages x fsdp 4, 2 repeats: an interleaved 1F1B step's shifts
  between stages (its only permutes, every stage sending: they wrap around) move a microbatch's
  activations R M + S - 2 times each way, not in each of the loop's R S + R M + S - 2
  iterations: not before the first forward or backward, nor from the last ones, whose outputs
  only the head or the embedding reads."""
  stages, repeats = 2, 2
  with on_devices(8):
    config = tiny_config(*SHARDED, "base_num_decoder_layers=4", "per_device_batch_size=2", _PP2,
                         "ici_fsdp_parallelism=4", "pipeline_schedule=1f1b", f"num_pipeline_repeats={repeats}",
                         f"num_pipeline_microbatches={count}")
    trainer = train_step.build(config, sharding.create_mesh(config))
    hlo = train_step.compile_train_step(trainer, config).as_text()
  sent = hlo_network.network_bytes(hlo, trainer.mesh)["by_type"]
  assert [key for key in sent if key.startswith("ppermute")] == ["ppermute f32"], sent
  rows = config.global_batch_size_to_train_on // count // config.ici_fsdp_parallelism
  block = rows * config.max_target_length * config.base_emb_dim * 4  # a device's share of one microbatch
  assert sent["ppermute f32"]["ici"] == pytest.approx(2 * (repeats * count + stages - 2) * block)


def test_a_circular_run_resumes_without_a_pipeline_and_with_one(tmp_path):
  """Checkpoints hold the layers in layer order whatever the stages: saved at step 2 under
  circular stages (which keep them in stage order), resumed under fsdp 8 and under the same
  stages, step 3's loss is the uninterrupted run's."""
  common = ("per_device_batch_size=1", "steps=3", f"base_output_directory={tmp_path}", "log_period=100",
            "enable_checkpointing=true", "checkpoint_period=2", "learning_rate_schedule_steps=3",
            "base_num_decoder_layers=4")
  circular = (_PP2, "ici_fsdp_parallelism=4", "num_pipeline_repeats=2")

  def run(name, *overrides):
    metrics_file = tmp_path / f"{name}.jsonl"
    with on_devices(8):
      train.train(tiny_config(*common, f"run_name={name}", f"metrics_file={metrics_file}", *overrides))
    return metrics_losses(metrics_file)

  uninterrupted = run("whole", *circular)
  for name, overrides in (("unpipelined", ("ici_fsdp_parallelism=8",)), ("circular", circular)):
    shutil.copytree(tmp_path / "whole", tmp_path / name)  # its step 2, as a run stopped there left it
    shutil.rmtree(tmp_path / name / "checkpoints" / "3")
    np.testing.assert_allclose(run(name, *overrides)[3], uninterrupted[3], rtol=1e-5, err_msg=name)


def test_with_no_schedule_named_stages_run_1f1b_and_circular_stages_gpipe():
  """1F1B wherever it runs (circular stages too where they keep residuals, which only 1F1B does);
  the planner's candidates, which name no schedule unless it is searched, resolve by the same rule."""
  with on_devices(8):
    assert tiny_config(*SHARDED, "base_num_decoder_layers=4", "per_device_batch_size=1").pipeline_schedule is None
    stages = tiny_config(*SHARDED, "base_num_decoder_layers=4", "per_device_batch_size=1", _PP2)
    circular = tiny_config(*SHARDED, "base_num_decoder_layers=4", "per_device_batch_size=1", _PP2,
                           "num_pipeline_repeats=2")
    kept = tiny_config(*SHARDED, "base_num_decoder_layers=4", "per_device_batch_size=1", _PP2,
                       "num_pipeline_repeats=2", "pipeline_keep_residuals=true")
    assert kept.pipeline_schedule == "1f1b"
    unpipelined = tiny_config(*SHARDED, "base_num_decoder_layers=4", "per_device_batch_size=1",
                              "ici_fsdp_parallelism=-1", "plan_pipeline_parallelism=[1,2]")
    candidates = [pyconfig.replace(unpipelined, {k: s[k] for k in plan.PIPELINE_KEYS})
                  for s in plan._settings(plan.search_space(unpipelined, set(plan.PIPELINE_KEYS)))]
  assert (stages.pipeline_schedule, circular.pipeline_schedule) == ("1f1b", "gpipe")
  assert [(c.pipeline_stages, c.pipeline_schedule) for c in candidates] == [(1, None), (2, "1f1b")]


def test_a_phase_counts_in_the_iterations_it_declares():
  """costs.runs_in: a cond's branch in a loop of 5 counts in the 3 iterations it declares; without
  the declaration, in every one."""
  square = lambda x: x @ x

  def flops(declared):
    def body(x, t):
      with costs.runs_in(3, 5) if declared else contextlib.nullcontext():
        return jax.lax.cond(t < 3, square, lambda x: x, x), None
    return costs.matmul_flops(jax.make_jaxpr(lambda x: jax.lax.scan(body, x, jnp.arange(5))[0])(
        jnp.ones((8, 8))).jaxpr)

  assert (flops(True), flops(False)) == (3 * 2 * 8**3, 5 * 2 * 8**3)


@pytest.mark.parametrize("repeats", [1, 2])
def test_1f1b_traces_the_work_of_its_microbatches_and_bubble_alone(repeats):
  """Traced FLOPs at M and 2M microbatches of one size: F(2M) - F(M) is M microbatches' work, and
  2 F(M) - F(2M) what the bubble's S - 1 iterations of a group of layers execute; a microbatch's
  work holds R groups and its head, so the bubble is at most (S - 1) / R microbatches' work. A
  count of every phase in every iteration of the loop (R S - 1 more) would exceed it."""
  flops = {}
  with on_devices(8):
    for count in (4, 8):
      config = tiny_config(*SHARDED, "base_num_decoder_layers=4", _PP2, "ici_fsdp_parallelism=4",
                           "pipeline_schedule=1f1b", f"num_pipeline_repeats={repeats}",
                           f"num_pipeline_microbatches={count}", f"per_device_batch_size={count / 2:g}")
      trainer = train_step.build(config, sharding.create_mesh(config))
      flops[count] = costs.matmul_flops(train_step.trace_train_step(trainer, config).jaxpr)
  per_microbatch, bubble = (flops[8] - flops[4]) / 4, 2 * flops[4] - flops[8]
  assert 0 < bubble <= (2 - 1) / repeats * per_microbatch * (1 + 1e-9), (bubble, per_microbatch)


@pytest.mark.parametrize("repeats", [1, 2])
def test_1f1b_keeping_residuals_traces_gpipes_flops(repeats):
  """With pipeline_keep_residuals each stage's backward starts from what its forward saved: the
  step executes the products autodiff of GPipe's schedule executes (the same bubble, the same
  recomputation under remat), one forward of the stages fewer than 1F1B without it."""
  flops = {}
  with on_devices(8):
    for schedule, keep in (("gpipe", False), ("1f1b", True), ("1f1b", False)):
      config = tiny_config(*SHARDED, "base_num_decoder_layers=4", _PP2, "ici_fsdp_parallelism=4",
                           f"pipeline_schedule={schedule}", f"pipeline_keep_residuals={keep}",
                           f"num_pipeline_repeats={repeats}", "num_pipeline_microbatches=4", "per_device_batch_size=2")
      trainer = train_step.build(config, sharding.create_mesh(config))
      flops[schedule, keep] = costs.matmul_flops(train_step.trace_train_step(trainer, config).jaxpr)
  assert flops["1f1b", True] == pytest.approx(flops["gpipe", False], rel=1e-9)
  assert flops["1f1b", False] > flops["1f1b", True]


@pytest.mark.parametrize("schedule, stages, repeats, count", [
    *[(schedule, *case) for schedule in ("gpipe", "1f1b") for case in [(2, 1, 2), (4, 1, 8), (2, 2, 4), (4, 3, 4)]],
    ("1f1b", 4, 1, 4)])
def test_bubble_counts_the_idle_stage_iterations(schedule, stages, repeats, count):
  """The loops' own timing: in GPipe stage s runs work item i = t - s (R M items), in 1F1B a
  forward of t - s and a backward of t - (R S - 1) - (S - 1 - s) (R M each), the loop running each
  phase only in the iterations where some stage has its work; a stage's executed phase without
  work is idle."""
  config = type("C", (), {"pipeline_stages": stages, "num_pipeline_repeats": repeats,
                          "num_pipeline_microbatches": count, "pipeline_schedule": schedule})
  work = repeats * count
  if schedule == "gpipe":
    slots = [(0 <= t - s < work) for t in range(work + stages - 1) for s in range(stages)]
  else:
    iterations = range(repeats * stages - 1 + work + stages - 1)
    backward = lambda t, s: t - (repeats * stages - 1) - (stages - 1 - s)
    forwards = [t for t in iterations if any(0 <= t - s < work for s in range(stages))]
    backwards = [t for t in iterations if any(0 <= backward(t, s) < work for s in range(stages))]
    slots = ([0 <= t - s < work for t in forwards for s in range(stages)]
             + [0 <= backward(t, s) < work for t in backwards for s in range(stages)])
  assert pipeline.bubble(config) == pytest.approx(1 - sum(slots) / len(slots))


@pytest.mark.parametrize("overrides, message", [
    ((_PP4, "base_num_decoder_layers=6"), r"base_num_decoder_layers=6: must be divisible by pipeline stages x repeats"),
    ((_PP2, "num_pipeline_repeats=2", "base_num_decoder_layers=6"), r"base_num_decoder_layers=6"),
    ((_PP4, "num_pipeline_microbatches=6"), r"num_pipeline_microbatches=6: must be a multiple of the 4"),
    ((_PP2, "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"), r"num_pipeline_microbatches=4: must split"),
    ((_PP2, "num_layers_per_pipeline_stage=1", "num_pipeline_repeats=1"), r"num_pipeline_repeats=1: disagrees"),
    # 3 layers a stage, not the 2 asked for, would run without a word.
    ((_PP2, "base_num_decoder_layers=6", "num_layers_per_pipeline_stage=2"),
     r"num_layers_per_pipeline_stage=2: times the 2 pipeline stages must divide the 6 layers"),
    ((_PP4, "decoder_block=qwen3_moe", "num_experts=4", "first_num_dense_layers=2"),
     r"base_num_decoder_layers=4: less first_num_dense_layers \(2 layers\) must be at least the 4 pipeline stages"),
    # Accepted where GPipe's autodiff or no pipeline runs, it would change nothing.
    (("pipeline_keep_residuals=true",), r"pipeline_keep_residuals=True: is 1F1B's: it needs pipeline stages"),
    ((_PP2, "pipeline_schedule=gpipe", "pipeline_keep_residuals=true"), r"pipeline_keep_residuals=True: is 1F1B's"),
])
def test_bad_pipeline_settings_are_config_errors(overrides, message):
  with on_devices(8), pytest.raises(errors.ConfigError, match=message):
    tiny_config(*SHARDED, "base_num_decoder_layers=4", "per_device_batch_size=1", *overrides)
