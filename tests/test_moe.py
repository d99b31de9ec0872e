"""Mixture of experts: the routed layer against a dense reference that runs every expert on every
token, capacity dropping against the rule played out in Python, the router's losses against
numpy, memory settings that leave the model unchanged, bad input, and training end to end."""

import functools
import json
import math
import re

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  assert_trees_close,
  fixed_batch,
  loss_and_gradients_of,
  loss_gradients,
  on_devices,
  run_command,
  sown_statistics,
  tiny_config,
  trainer_and_state,
)

from MaxText import costs, errors, sharding, train, train_step
from MaxText.layers import moe
from MaxText.layers.models import Transformer

# 4 experts, top 2, expert width 24 over TINY (width 32, 16 tokens, 4 rows).
MOE = ("decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24")
RTOL = 1e-5


def dense_reference(params, x, cfg, keep=None):
  """Every expert on every token (einsum), combined with the router's top-k weights (times
  keep [B, T, k], 0 for a dropped copy): no sorting, no grouped matmul."""
  logits = jnp.einsum("btd,de->bte", x, params["gate"]["kernel"])
  weights, experts = jax.lax.top_k(jax.nn.softmax(logits), cfg.num_experts_per_tok)
  if cfg.norm_topk_prob:
    weights = weights / weights.sum(-1, keepdims=True)
  if keep is not None:
    weights = weights * keep
  combine = jnp.einsum("btk,btke->bte", weights, jax.nn.one_hot(experts, cfg.num_experts))
  h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, params["wi_0"])) * jnp.einsum("btd,edf->btef", x, params["wi_1"])
  return jnp.einsum("bte,btef,edf->btd", combine, h, params["wo"])


def layer_and_inputs(cfg, seed=0):
  block = moe.MoeBlock(cfg)
  x = jax.random.normal(jax.random.key(seed), (cfg.micro_batch_size, cfg.max_target_length, cfg.base_emb_dim))
  params = jax.device_get(nn.meta.unbox(block.init(jax.random.key(seed + 1), x)["params"]))
  return block, params, x


def outputs_loss_grads(fn, params, x):
  """fn(params, x), and the loss sum((fn - a fixed target)^2) with its gradients in params and x (a
  sum of squares: a signed sum could cancel to a value rtol cannot compare)."""
  target = jax.random.normal(jax.random.key(7), x.shape)
  loss = lambda p, x: jnp.sum(jnp.square(fn(p, x) - target))
  value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
  return fn(params, x), value, grads


@pytest.mark.parametrize("grouped_matmul", ["xla", "tokamax"])
def test_dropless_layer_equals_every_expert_on_every_token(grouped_matmul, monkeypatch):
  if grouped_matmul == "tokamax":  # the GPU's: on CPU tokamax runs its XLA fallback under its own backward
    monkeypatch.setitem(moe.RAGGED_DOT_GENERAL, "cpu", moe._tokamax_ragged_dot_general)
  cfg = tiny_config(*MOE, num_devices=1)
  block, params, x = layer_and_inputs(cfg)
  got = outputs_loss_grads(lambda p, x: block.apply({"params": p}, x), params, x)
  want = outputs_loss_grads(lambda p, x: dense_reference(p, x, cfg), params, x)
  assert_trees_close(got, want, RTOL, "dropless")


def capacity_keep(experts, num_experts, capacity_factor):
  """[B, T, k] 1 for the copies the capacity keeps: per row, walking the tokens in order and each
  token's choices in order, an expert accepts copies until it holds its capacity."""
  rows, length, k = experts.shape
  cap = int(max(math.ceil(length * k / num_experts) * capacity_factor, capacity_factor))
  keep = np.zeros(experts.shape, np.float32)
  for b in range(rows):
    held = [0] * num_experts
    for t in range(length):
      for j in range(k):
        e = experts[b, t, j]
        if held[e] < cap:
          held[e] += 1
          keep[b, t, j] = 1
  return keep


# The top-k weights unnormalised in one case, so that switch is covered too.
@pytest.mark.parametrize("capacity_factor, norm", [(0.5, False), (2.0, True)])
def test_capacity_drops_exactly_the_copies_past_capacity(capacity_factor, norm):
  cfg = tiny_config(*MOE, f"capacity_factor={capacity_factor}", f"norm_topk_prob={norm}", num_devices=1)
  block, params, x = layer_and_inputs(cfg)
  logits = np.einsum("btd,de->bte", np.asarray(x, np.float64), params["gate"]["kernel"])
  experts = np.argsort(-logits, axis=-1, kind="stable")[..., :cfg.num_experts_per_tok]
  keep = capacity_keep(experts, cfg.num_experts, capacity_factor)
  if capacity_factor < 1:
    assert keep.mean() < 0.9  # the case under test drops copies
  if capacity_factor >= 2:
    assert keep.min() == 1  # C = 2 T k / E = T: no expert can receive more copies from a row
  got = outputs_loss_grads(lambda p, x: block.apply({"params": p}, x), params, x)
  want = outputs_loss_grads(lambda p, x: dense_reference(p, x, cfg, keep), params, x)
  assert_trees_close(got, want, RTOL, f"capacity_factor={capacity_factor}")


def shapes_in(jaxpr) -> set:
  """The shapes of every value a jaxpr and the jaxprs inside it (shard_map, scans, ...) make."""
  shapes = set()
  for eqn in jaxpr.eqns:
    shapes |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes |= shapes_in(sub)
  return shapes


def test_capacity_routing_holds_no_buffer_of_every_copy():
  # Fewer slots than copies (DeepSeek-V3 on 8 experts' devices: 1.25 N against 8 N): neither the
  # forward nor the backward may hold every copy's row, in any layout.
  cfg = tiny_config(*MOE, "capacity_factor=0.5", num_devices=1)
  block, params, x = layer_and_inputs(cfg)
  tokens, k, width = x.shape[0] * x.shape[1], cfg.num_experts_per_tok, x.shape[-1]
  loss = lambda p, x: jnp.sum(jnp.square(block.apply({"params": p}, x)))
  shapes = shapes_in(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x).jaxpr)
  assert (tokens, width) in shapes  # the walk sees the layer's values
  assert not shapes & {(tokens * k, width), (tokens * k + 1, width), (tokens, k, width)}, sorted(shapes)


def test_router_losses_and_imbalance_match_numpy():
  cfg = tiny_config(*MOE, num_devices=1)
  block, params, x = layer_and_inputs(cfg, seed=3)
  sown = sown_statistics(block, params, x)
  logits = np.einsum("btd,de->bte", np.asarray(x, np.float64), params["gate"]["kernel"]).reshape(-1, cfg.num_experts)
  lse = np.log(np.exp(logits).sum(-1))
  probs = np.exp(logits - lse[:, None])
  chosen = np.argsort(-probs, axis=-1)[:, :cfg.num_experts_per_tok]
  load = np.bincount(chosen.ravel(), minlength=cfg.num_experts)
  tokens = logits.shape[0]
  want = {"moe_lb_loss": cfg.num_experts * np.sum(load / tokens * probs.mean(0)),
          "moe_z_loss": np.mean(lse**2), "moe_imbalance": load.max() / load.mean(), moe.EXPERT_LOAD: load}
  want["moe_aux_loss"] = (cfg.load_balance_loss_weight * want["moe_lb_loss"]
                          + cfg.router_z_loss_weight * want["moe_z_loss"])
  assert sown.keys() == want.keys()
  for name in want:
    np.testing.assert_allclose(sown[name], want[name], rtol=RTOL, err_msg=name)


# Router losses on, so their gradients are part of what must not change.
WEIGHTED = (*MOE, "load_balance_loss_weight=0.1", "router_z_loss_weight=0.01")
MEMORY_SETTINGS = {
    "minimal, interval 2, mlp 2 slices": ("remat_policy=minimal", "remat_layer_interval=2", "mlp_chunks=2"),
    "save_dot_except_mlp, tiles 4, loop": ("remat_policy=save_dot_except_mlp", "num_vocab_tiling=4",
                                           "scan_layers=false"),
    "full, tiles 4 recompute, mlp 3 slices": ("remat_policy=full", "num_vocab_tiling=4", "vocab_tiling_mode=recompute",
                                              "mlp_chunks=3"),
}


@pytest.mark.slow
def test_memory_settings_give_the_same_loss_and_gradients():
  reference = tiny_config(*WEIGHTED, "remat_policy=none", "scan_layers=false")
  _, state = trainer_and_state(reference)
  params, batch = jax.device_get(state.params), fixed_batch(reference)
  want_loss, want_grads = loss_and_gradients_of(reference, params, batch)
  assert np.any(np.asarray(want_grads["decoder"]["layers"]["moe_block"]["gate"]["kernel"]))
  for name, overrides in MEMORY_SETTINGS.items():
    loss, grads = loss_and_gradients_of(tiny_config(*WEIGHTED, *overrides), params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=name)
    assert_trees_close(grads, want_grads, 1e-5, name)


def test_model_flops_count_active_parameters_only():
  """6 FLOPs per token per active weight (the router, k of the E experts, attention projections
  and the head, counted from the parameter tree) plus the causal attention products."""
  cfg = tiny_config(*MOE, num_devices=1)
  tokens = jnp.zeros((1, cfg.max_target_length), jnp.int32)
  init = lambda: Transformer(cfg).init(jax.random.key(0), tokens, tokens, tokens)
  params = nn.meta.unbox(jax.eval_shape(init)["params"])
  layer = params["decoder"]["layers"]
  experts = sum(math.prod(layer["moe_block"][n].shape[2:]) for n in ("wi_0", "wi_1", "wo"))
  attention = sum(math.prod(layer["self_attention"][n]["kernel"].shape[1:]) for n in ("query", "key", "value", "out"))
  per_layer = attention + math.prod(layer["moe_block"]["gate"]["kernel"].shape[1:]) + cfg.num_experts_per_tok * experts
  active = cfg.base_num_decoder_layers * per_layer + math.prod(params["logits_kernel"].shape)
  tokens = cfg.global_batch_size_to_train_on * cfg.max_target_length
  scores = 3 * 2 * 2 * tokens * cfg.max_target_length / 2 * cfg.base_num_query_heads * cfg.head_dim
  want = 6 * tokens * active + scores * cfg.base_num_decoder_layers
  assert costs.training_flops_per_step(cfg) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("policy", ["full", "none"])
def test_the_experts_in_slices_trace_the_flops_of_the_whole_experts(policy):
  """mlp_chunks recomputes nothing more: the traced step's matmul FLOPs (recomputation
  included) with the experts in 3 slices equal those of the unsliced experts."""
  def traced_flops(*overrides):
    cfg = tiny_config(*MOE, f"remat_policy={policy}", *overrides, num_devices=1)
    trainer = train_step.build(cfg, sharding.create_mesh(cfg))
    return costs.matmul_flops(train_step.trace_train_step(trainer, cfg).jaxpr)

  assert traced_flops("mlp_chunks=3") == traced_flops()


@pytest.mark.parametrize("override, message", [
    ("num_experts_per_tok=5", "num_experts_per_tok=5: must be in \\[1, num_experts=4\\]"),
    ("num_experts_per_tok=0", "num_experts_per_tok=0: must be in"),
    ("capacity_factor=-0.5", "capacity_factor=-0.5: must be > 0 .* or null"),
    ("capacity_factor=0", "capacity_factor=0.0: must be > 0 .* or null"),
    ("capacity_factor=null", None),
    ("capacity_factor=0.1", "capacity_factor=0.1: gives each expert 0 slots per sequence of max_target_length=16"),
    ("expert_exchange=ring", "expert_exchange=ring: must be one of auto, all_gather, all_to_all"),
    ("capacity_factor=1.25 expert_exchange=all_to_all", "expert_exchange='all_to_all': all_to_all needs dropless"),
])
def test_bad_moe_values_name_the_key(override, message):
  if message is None:  # dropless
    assert moe.dropless(tiny_config(*MOE, override, num_devices=1).capacity_factor)
  else:
    with pytest.raises(errors.ConfigError, match=message):
      tiny_config(*MOE, *override.split(), num_devices=1)


def test_the_cpu_ragged_all_to_all_gives_the_example_of_jaxs_docstring():
  """XLA:CPU lacks ragged-all-to-all; its stand-in (moe.RAGGED_ALL_TO_ALL) against the worked
  example of jax.lax.ragged_all_to_all's docstring, the two devices as a named vmap axis."""
  rows = lambda *per_device: jnp.array(per_device, jnp.int32)
  exchange = jax.vmap(functools.partial(moe.RAGGED_ALL_TO_ALL["cpu"], axis_name="i"), axis_name="i")
  result = exchange(rows([1, 2, 2], [3, 4, 0]), rows([0, 0, 0, 0], [0, 0, 0, 0]), rows([0, 1], [0, 1]),
                    rows([1, 2], [1, 1]), rows([0, 0], [1, 2]), rows([1, 1], [2, 1]))
  np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_bad_moe_input_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
  out = tmp_path / "outputs"
  with pytest.raises(errors.ConfigError, match="num_experts_per_tok=5") as error:
    run_command("train", f"base_output_directory={out}", *MOE, "num_experts_per_tok=5")
  assert "\n" not in str(error.value)
  assert not out.exists()


@pytest.mark.parametrize("overrides, message", [
    (('logical_axis_rules=[["exp", ["fsdp"]]]', "num_experts=6"), "num_experts=6: not divisible by .* fsdp \\(4\\)"),
    (("ici_tensor_parallelism=2", "base_moe_mlp_dim=25"), "base_moe_mlp_dim=25: not divisible by .* tensor \\(2\\)"),
])
def test_a_mesh_that_does_not_divide_the_experts_is_a_config_error(overrides, message):
  with pytest.raises(errors.ConfigError, match=message):
    tiny_config(*MOE, *overrides, num_devices=4)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_training_runs_end_to_end_and_logs_the_router(tmp_path, family):
  metrics_file = tmp_path / "metrics.jsonl"
  config = tiny_config(*MOE, f"decoder_block={family}", "steps=3", "gradient_accumulation_steps=2",
                       "eval_interval=3", "eval_steps=1", f"base_output_directory={tmp_path}",
                       f"metrics_file={metrics_file}", "router_z_loss_weight=0.001")
  train.train(config)
  records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
  steps = [r for r in records if "learning/loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3]
  for r in steps:
    assert all(np.isfinite(r[f"learning/{n}"]) for n in moe.AUX_NAMES), r
    assert r["learning/moe_imbalance"] >= 1 and r["learning/moe_lb_loss"] > 0 and r["learning/moe_z_loss"] > 0
    aux = config.load_balance_loss_weight * r["learning/moe_lb_loss"] + 0.001 * r["learning/moe_z_loss"]
    np.testing.assert_allclose(r["learning/moe_aux_loss"], aux, rtol=1e-5)
  assert any("eval/loss" in r and np.isfinite(r["eval/loss"]) for r in records)


# 8 experts of width 24, top 2, over TINY: every mesh below divides it with one row per device.
# All but the last divide the experts over the expert and FSDP axes, so FSDP shards the experts;
# in the last FSDP shards D (moe.MoeBlock). Each name says how the tokens reach their experts:
# expert_exchange=auto picks the all-to-all where the expert axis is larger than top-k (2).
EXPERTS_8 = ("decoder_block=qwen3_moe", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
             "load_balance_loss_weight=0.1", "router_z_loss_weight=0.01")
EXPERT_MESHES = {
    "expert=8, all-to-all": ("ici_expert_parallelism=8", "ici_fsdp_parallelism=1"),
    "expert=2 tensor=2 data=2, all-gather, mlp 2 slices": ("ici_expert_parallelism=2", "ici_tensor_parallelism=2",
                                                           "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                                                           "mlp_chunks=2"),
    "expert=2 context=2 fsdp=2, all-to-all, mlp 2 slices": ("ici_expert_parallelism=2", "ici_context_parallelism=2",
                                                            "ici_fsdp_parallelism=2", "expert_exchange=all_to_all",
                                                            "mlp_chunks=2"),
    # Dropping: the capacity is per sequence, and each device's experts see whole sequences. (The
    # all-gather without dropping runs on the expert=2 meshes.)
    "expert=8, capacity 1, all-gather": ("ici_expert_parallelism=8", "ici_fsdp_parallelism=1",
                                         "capacity_factor=1.0"),
    "fsdp=8, 4 experts, mlp 3 slices": ("ici_fsdp_parallelism=8", "num_experts=4", "mlp_chunks=3"),
}
# The GPU's grouped matmul (tokamax, its XLA fallback on CPU) under its own backward, on the mesh
# whose weight gradients are summed over most axes (the exchange its all-to-all: the all-gather
# exchange is the same grouped matmul on the gathered tokens).
TOKAMAX_MESHES = {
    "expert=2 tensor=2 data=2, all-to-all, mlp 2 slices, tokamax":
        (*EXPERT_MESHES["expert=2 tensor=2 data=2, all-gather, mlp 2 slices"], "expert_exchange=all_to_all"),
}


def _model(overrides) -> tuple:
  """The overrides that change the model (its parameters or routing), not the mesh."""
  return tuple(o for o in overrides if o.startswith(("capacity_factor", "num_experts")))


def _parameters(model) -> tuple:
  """Those of `model`'s overrides that change its parameters: a capacity changes only the routing."""
  return tuple(o for o in model if o.startswith("num_experts"))


@functools.cache
def _one_device_params(*parameters):
  return jax.device_get(trainer_and_state(tiny_config(*EXPERTS_8, "per_device_batch_size=8", *parameters))[1].params)


def one_device_params(*model):
  """The initial parameters on this process's single device: the meshes start from them (a
  model initialised on an expert mesh is tested in test_pipeline's mixture-of-experts case),
  one initialisation compiled for the models that differ only in capacity."""
  return _one_device_params(*_parameters(model))


@pytest.fixture(scope="module")
def expert_mesh_results():
  """{mesh: (the summed training loss and its gradients at one device's initial parameters on
  fixed_batch, how many ragged all-to-alls the model traced, the compiled HLO)} on 8 devices."""
  exchanges = []  # XLA:CPU's stand-in for the ragged all-to-all, counted
  ragged_all_to_all = moe.RAGGED_ALL_TO_ALL["cpu"]
  results = {}
  with pytest.MonkeyPatch.context() as patch, on_devices(8):
    patch.setitem(moe.RAGGED_ALL_TO_ALL, "cpu", lambda *args, **kwargs: exchanges.append(1) or ragged_all_to_all(
        *args, **kwargs))
    for name, overrides in {**EXPERT_MESHES, **TOKAMAX_MESHES}.items():
      if name in TOKAMAX_MESHES:  # the last ones
        patch.setitem(moe.RAGGED_DOT_GENERAL, "cpu", moe._tokamax_ragged_dot_general)
      exchanges.clear()
      hlo = []
      results[name] = loss_gradients(tiny_config(*EXPERTS_8, "per_device_batch_size=1", *overrides),
                                     params=one_device_params(*_model(overrides)), hlo=hlo), len(exchanges), hlo[0]
  return results


@functools.cache
def one_device_loss_and_gradients_of(*model):
  return loss_gradients(tiny_config(*EXPERTS_8, "per_device_batch_size=8", *model), params=one_device_params(*model))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [*EXPERT_MESHES, *TOKAMAX_MESHES])
def test_expert_parallel_meshes_equal_one_device(expert_mesh_results, mesh):
  got, ragged_all_to_alls, _ = expert_mesh_results[mesh]
  want = one_device_loss_and_gradients_of(*_model({**EXPERT_MESHES, **TOKAMAX_MESHES}[mesh]))
  assert (ragged_all_to_alls > 0) == ("all-to-all" in mesh), mesh
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=RTOL, err_msg=mesh)
  assert_trees_close(got, want, RTOL, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["expert=2 context=2 fsdp=2, all-to-all, mlp 2 slices",
                                  "fsdp=8, 4 experts, mlp 3 slices"])
def test_with_mlp_slices_fsdp_gathers_one_slice_of_the_experts_at_a_time(expert_mesh_results, mesh):
  """FSDP's all-gathers of the expert kernels [experts, D, F] (each device's experts, whole)
  give F / mlp_chunks hidden units: with slices, never the whole F."""
  overrides = EXPERT_MESHES[mesh]
  cfg = tiny_config(*EXPERTS_8, "per_device_batch_size=1", *overrides, num_devices=8)
  chunks = cfg.mlp_chunks
  gathered = {tuple(map(int, dims.split(","))) for dims in
              re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", expert_mesh_results[mesh][2])}
  experts_here = cfg.num_experts // cfg.ici_expert_parallelism
  widths = {dims[-1] for dims in gathered if dims[-3:-1] == (experts_here, cfg.base_emb_dim)}
  assert widths == {cfg.base_moe_mlp_dim // chunks}, (mesh, gathered)


def test_experts_not_divisible_by_the_expert_axis_are_one_line_and_train_writes_nothing(tmp_path):
  out = tmp_path / "outputs"
  message = "num_experts=6: not divisible by .*expert \\(4\\)"
  with on_devices(4), pytest.raises(errors.ConfigError, match=message) as error:
    run_command("train", f"base_output_directory={out}", *MOE, "num_experts=6", "ici_expert_parallelism=4")
  assert "\n" not in str(error.value)
  assert not out.exists()


def test_expert_weights_shard_over_expert_and_dense_weights_over_every_batch_axis():
  """Under expert parallelism no parameter is replicated over the expert axis."""
  cfg = tiny_config(*MOE, "ici_expert_parallelism=2", "ici_fsdp_parallelism=2", num_devices=4)
  rules = sharding.axis_rules(cfg)
  assert nn.logical_to_mesh_axes(("exp", "embed", "mlp"), rules) == jax.sharding.PartitionSpec(
      "expert", ("fsdp", "context"), "tensor")
  assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == jax.sharding.PartitionSpec(
      ("fsdp", "context", "expert"), "tensor")



@pytest.mark.parametrize("rules", ["default", "without exp_fsdp"])
def test_the_experts_shard_over_fsdp_by_the_exp_fsdp_rule_and_else_by_exp_and_embed(rules):
  """4 experts over fsdp 4: FSDP shards the experts' axis where a rule names exp_fsdp; rules of
  the user's own without it shard them by their exp and embed rules (D over fsdp), not replicate them."""
  overrides = (*MOE, "ici_fsdp_parallelism=4")
  if rules != "default":
    kept = [rule for rule in tiny_config(*overrides, num_devices=4).logical_axis_rules if rule[0] != "exp_fsdp"]
    overrides += (f"logical_axis_rules={json.dumps(kept)}",)
  cfg = tiny_config(*overrides, num_devices=4)
  x = jnp.zeros((cfg.micro_batch_size, cfg.max_target_length, cfg.base_emb_dim))
  boxed = jax.eval_shape(moe.MoeBlock(cfg).init, jax.random.key(0), x)["params"]
  spec = nn.logical_to_mesh_axes(nn.get_partition_spec(boxed)["wi_0"], sharding.axis_rules(cfg))
  want = ((("expert", "fsdp", "context"), None, "tensor") if rules == "default"
          else ("expert", ("fsdp", "context"), "tensor"))
  assert tuple(spec) == want, spec
