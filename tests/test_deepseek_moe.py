"""DeepSeek-V3's mixture of experts: sigmoid scores, the correction bias (chosen by, trained by
load), group-limited top-k, routed scaling and shared experts against a dense every-expert
reference routed in numpy; the bias's update after a train step against the step's routing
recomputed in numpy; dense first layers against a Python loop of the layers; bad input."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import (
  assert_trees_close,
  fixed_batch,
  loss_and_gradients_of,
  on_devices,
  sown_statistics,
  tiny_config,
  trainer_and_state,
)

from MaxText import costs, errors, optimizers, sharding, train_step
from MaxText.layers import decoders, moe
from MaxText.layers.models import Transformer
from MaxText.layers.normalizations import rms_norm_with

# 8 experts in 4 groups of 2, each token's 3 experts from its 2 best groups, over TINY (width 32).
DEEPSEEK = ("decoder_block=qwen3_moe", "num_experts=8", "num_experts_per_tok=3", "base_moe_mlp_dim=16",
            "routed_score_func=sigmoid", "routed_bias=true", "n_routing_groups=4", "topk_routing_group=2",
            "routed_scaling_factor=2.5", "shared_experts=2", "load_balance_loss_weight=0.1",
            "router_z_loss_weight=0.01")
RTOL = 1e-5


def numpy_choice(logits, bias, cfg, groups=True):
  """[..., k] experts: the top-k of sigmoid(logits) + bias within the topk_routing_group groups
  whose two best biased scores sum highest (float64, sorting)."""
  choice = 1 / (1 + np.exp(-np.asarray(logits, np.float64))) + np.asarray(bias, np.float64)
  if groups:
    grouped = choice.reshape(*choice.shape[:-1], cfg.n_routing_groups, -1)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    dropped = np.argsort(-group_scores, axis=-1, kind="stable")[..., cfg.topk_routing_group:]
    np.put_along_axis(grouped, dropped[..., None].repeat(grouped.shape[-1], -1), -np.inf, axis=-2)
    choice = grouped.reshape(choice.shape)
  return np.argsort(-choice, axis=-1, kind="stable")[..., :cfg.num_experts_per_tok]


def dense_reference(params, x, experts, cfg):
  """Every expert on every token, combined with the normalised, scaled sigmoid scores of `experts`
  (fixed: the routing is numpy's), plus the shared experts' SwiGLU."""
  scores = jax.nn.sigmoid(jnp.einsum("btd,de->bte", x, params["gate"]["kernel"]))
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  weights = cfg.routed_scaling_factor * weights / weights.sum(-1, keepdims=True)
  combine = jnp.einsum("btk,btke->bte", weights, jax.nn.one_hot(experts, cfg.num_experts))
  h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, params["wi_0"])) * jnp.einsum("btd,edf->btef", x, params["wi_1"])
  shared = {n: params["shared_experts"][n]["kernel"] for n in ("wi_0", "wi_1", "wo")}
  hs = jax.nn.silu(x @ shared["wi_0"]) * (x @ shared["wi_1"])
  return jnp.einsum("bte,btef,edf->btd", combine, h, params["wo"]) + jnp.einsum("btm,dm->btd", hs, shared["wo"])


def outputs_loss_grads(fn, params, x):
  """fn(params, x), and the loss sum((fn - a fixed target)^2) with its gradients in params and x,
  jitted."""
  target = jax.random.normal(jax.random.key(7), x.shape)

  def loss(p, x):
    out = fn(p, x)
    return jnp.sum(jnp.square(out - target)), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


def test_routed_and_shared_experts_equal_every_expert_routed_in_numpy():
  cfg = tiny_config(*DEEPSEEK, num_devices=1)
  block = moe.MoeBlock(cfg)
  x = jax.random.normal(jax.random.key(0), (cfg.micro_batch_size, cfg.max_target_length, cfg.base_emb_dim))
  params = jax.device_get(nn.meta.unbox(jax.jit(block.init)(jax.random.key(1), x)["params"]))
  params["gate"]["bias"] = np.asarray(jax.random.normal(jax.random.key(2), (cfg.num_experts,)) * 0.3)
  logits = np.einsum("btd,de->bte", np.asarray(x, np.float64), params["gate"]["kernel"])
  experts = numpy_choice(logits, params["gate"]["bias"], cfg)
  # The case under test: the bias and the groups each change some token's experts.
  assert np.any(np.sort(experts) != np.sort(numpy_choice(logits, 0 * params["gate"]["bias"], cfg)))
  assert np.any(np.sort(experts) != np.sort(numpy_choice(logits, params["gate"]["bias"], cfg, groups=False)))
  got = outputs_loss_grads(lambda p, x: block.apply({"params": p}, x), params, x)
  want = outputs_loss_grads(lambda p, x: dense_reference(p, x, experts, cfg), params, x)
  assert_trees_close(got, want, RTOL, "routed")
  # The router's statistics are those of the biased choice; the balancing loss takes the scores
  # normalised per token.
  sown = sown_statistics(block, params, x)
  load = np.bincount(experts.ravel(), minlength=cfg.num_experts)
  scores = 1 / (1 + np.exp(-logits.reshape(-1, cfg.num_experts)))
  probs = scores / scores.sum(-1, keepdims=True)
  want_stats = {moe.EXPERT_LOAD: load, "moe_imbalance": load.max() / load.mean(),
                "moe_lb_loss": cfg.num_experts * np.sum(load / len(probs) * probs.mean(0))}
  for name, value in want_stats.items():
    np.testing.assert_allclose(sown[name], value, rtol=RTOL, err_msg=name)


# Two layers, the first dense: both stacks; the bias moved each step, the optimizer decaying weights.
STACKED = (*DEEPSEEK, "first_num_dense_layers=1", "routed_bias_update_rate=0.01", "adam_weight_decay=0.5",
           "per_device_batch_size=8")


@pytest.fixture(scope="module")
def stacked():
  """(config, Trainer, TrainState) of STACKED on one device, the MoE layer's bias set off zero."""
  config = tiny_config(*STACKED)
  trainer, state = trainer_and_state(config)
  params = jax.device_get(state.params)
  params["decoder"]["moe_layers"]["moe_block"]["gate"]["bias"] = np.asarray(
      jax.random.normal(jax.random.key(5), (1, config.num_experts)) * 0.3, np.float32)
  return config, trainer, state.replace(params=jax.device_put(params, trainer.state_sharding.params))


def test_expert_4_by_fsdp_2_gives_one_devices_loss_and_gradients(stacked):
  config, _, state = stacked
  params, batch = jax.device_get(state.params), fixed_batch(config)
  want = loss_and_gradients_of(config, params, batch)
  with on_devices(8):
    mesh = tiny_config(*STACKED[:-1], "per_device_batch_size=1", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
    got = loss_and_gradients_of(mesh, params, batch)
  assert np.any(got[1]["decoder"]["moe_layers"]["moe_block"]["shared_experts"]["wo"]["kernel"])
  assert_trees_close(got, want, RTOL, "expert=4 fsdp=2")


def test_the_bias_moves_by_the_steps_load_and_nothing_else_and_round_trips(stacked, tmp_path):
  """After one train step (AdamW with weight decay), the MoE layer's bias is the old plus
  rate * sign(mean load - load), the load recomputed in numpy from the router's logits of that
  step; the state saved restores under other memory settings (the stored layout is theirs too)."""
  config, trainer, state = stacked
  params, batch = jax.device_get(state.params), fixed_batch(config)
  bias = params["decoder"]["moe_layers"]["moe_block"]["gate"]["bias"]
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  _, captured = jax.jit(functools.partial(trainer.model.apply, mutable="intermediates", capture_intermediates=lambda
                                          module, _: isinstance(module, moe.Gate)))({"params": params}, *inputs)
  calls = captured["intermediates"]["decoder"]["moe_layers"]["blocks"]["layer_0"]["moe_block"]["gate"]["__call__"]
  logits, _ = calls[-1]  # the Gate's own output (DenseGeneral's, inside it, ends first), [scan steps, ...]
  load = np.bincount(numpy_choice(logits[0], bias[0], config).ravel(), minlength=config.num_experts)
  assert np.all(load != load.mean())  # a step that moves every expert's bias
  want = bias + np.float32(0.01) * np.sign(load.mean() - load).astype(np.float32)

  with sharding.activate(trainer.mesh, config):
    new, _ = trainer.train_step(state, train_step.device_batch(trainer, batch))
  new = jax.device_get(new)
  gate = new.params["decoder"]["moe_layers"]["moe_block"]["gate"]
  np.testing.assert_allclose(gate["bias"], want, rtol=1e-6)
  assert not np.allclose(gate["kernel"], params["decoder"]["moe_layers"]["moe_block"]["gate"]["kernel"])

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "state", new)
  other = tiny_config(*STACKED, "remat_layer_interval=2", "scan_layers=false")
  trainer = train_step.build(other, sharding.create_mesh(other))
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), trainer.abstract_state,
                          trainer.state_sharding)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "state", abstract)
  saved = lambda state: (state.step, state.params, state.opt_state)
  assert_trees_close(saved(jax.device_get(restored)), saved(new), 0, "restored")


def test_the_optimizer_neither_applies_a_gradient_to_the_bias_nor_decays_it():
  config = tiny_config(*DEEPSEEK, "adam_weight_decay=0.5", num_devices=1)
  params = {"decoder": {"layers": {"moe_block": {"gate": {"kernel": jnp.ones((2, 4, 8)), "bias": jnp.ones((2, 8))}}}}}
  tx = optimizers.create_optimizer(config)
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  gate = updates["decoder"]["layers"]["moe_block"]["gate"]
  assert np.all(np.asarray(gate["bias"]) == 0) and np.all(np.asarray(gate["kernel"]) != 0)


# 2 dense layers and a MoE layer, scanned in blocks of 2: the dense stack is one block, the MoE stack
# one layer left over.
THREE = (*DEEPSEEK, "base_num_decoder_layers=3", "first_num_dense_layers=2", "remat_layer_interval=2",
         "remat_policy=none")


def test_dense_first_layers_equal_a_python_loop_of_the_stored_layers():
  cfg = tiny_config(*THREE, num_devices=1)
  x = jax.random.normal(jax.random.key(0), (2, cfg.max_target_length, cfg.base_emb_dim))
  positions = jnp.broadcast_to(jnp.arange(cfg.max_target_length), x.shape[:2])
  segments = jnp.ones(x.shape[:2], jnp.int32)
  decoder = decoders.Decoder(cfg)
  params = jax.device_get(nn.meta.unbox(jax.jit(decoder.init)(jax.random.key(1), x, positions, segments)["params"]))
  assert jax.tree.leaves(params["dense_layers"])[0].shape[0] == 2 and "mlp" in params["dense_layers"]
  assert params["moe_layers"]["moe_block"]["gate"]["bias"].shape == (1, cfg.num_experts)

  def loop(p, x):
    for i, (stack, index, is_moe) in enumerate([("dense_layers", 0, False), ("dense_layers", 1, False),
                                                 ("moe_layers", 0, True)]):
      layer = jax.tree.map(lambda w, index=index: w[index], p[stack])
      x = decoders.DecoderLayer(cfg, is_moe).apply({"params": layer}, x, positions, segments, i)
    return rms_norm_with(cfg, p["decoder_norm"]["scale"], x)

  got = outputs_loss_grads(lambda p, x: decoder.apply({"params": p}, x, positions, segments)[0], params, x)
  assert_trees_close(got, outputs_loss_grads(loop, params, x), RTOL, "scan, interval 2")


@pytest.mark.parametrize("settings", [(), ("remat_layer_interval=2",), ("remat_layer_interval=2", "scan_layers=false")],
                         ids=" ".join)
def test_expert_loads_come_back_in_layer_order(settings):
  """decoders.expert_loads undoes regroup: loads stored [depth, E] in layer order, grouped as the
  layer stack sows them, come back as they were."""
  cfg = tiny_config(*DEEPSEEK, "base_num_decoder_layers=4", "first_num_dense_layers=1", *settings, num_devices=1)
  loads = np.arange(3 * cfg.num_experts, dtype=np.float32).reshape(3, -1)
  sown = decoders.regroup(cfg, decoders.stacks(cfg)[-1], {"moe_block": {moe.EXPERT_LOAD: (loads,)}})
  np.testing.assert_array_equal(decoders.expert_loads(cfg, {"decoder": {"moe_layers": sown}})["moe_layers"], loads)


def active_weights(cfg) -> int:
  """The weights a token's matmuls pass through, counted from the parameter tree: every kernel
  (the router's, the shared experts', the dense MLPs', attention's, the head's), and of the routed
  experts' num_experts_per_tok of num_experts."""
  tokens = jnp.zeros((1, cfg.max_target_length), jnp.int32)
  params = nn.meta.unbox(jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tokens, tokens,
                                                                      tokens))["params"])
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = [key.key for key in path]
    if names[-1] in ("wi_0", "wi_1", "wo") and names[-2] == "moe_block":
      total += math.prod(leaf.shape) * cfg.num_experts_per_tok // cfg.num_experts
    elif names[-1].endswith("kernel"):
      total += math.prod(leaf.shape)
  return total


def test_flops_count_the_shared_experts_and_the_dense_layers():
  """The model FLOPs of a dense-first model with shared experts minus those of the same model all
  routed without them: 6 per token per active weight of the difference, the weights counted from
  the two parameter trees (attention's products are the same in both)."""
  cfg = tiny_config(*THREE, num_devices=1)
  plain = tiny_config(*THREE[:-3], "shared_experts=0", num_devices=1)
  tokens = cfg.global_batch_size_to_train_on * cfg.max_target_length
  assert active_weights(cfg) != active_weights(plain)
  assert costs.training_flops_per_step(cfg) - costs.training_flops_per_step(plain) == pytest.approx(
      6 * tokens * (active_weights(cfg) - active_weights(plain)), rel=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (("n_routing_groups=4", "topk_routing_group=5"), "topk_routing_group=5: must be <= n_routing_groups=4"),
    (("n_routing_groups=3", "topk_routing_group=1"), "n_routing_groups=3: must divide num_experts=8"),
    (("n_routing_groups=4", "topk_routing_group=-1"), "topk_routing_group=-1: and n_routing_groups=4 must be both"),
    (("base_num_decoder_layers=2", "first_num_dense_layers=2"), "first_num_dense_layers=2: must be below "
                                                                "base_num_decoder_layers=2"),
    (("decoder_block=llama2", "first_num_dense_layers=1"),
     "first_num_dense_layers=1: counts the dense layers before the experts in a mixture of experts; "
     "decoder_block=llama2 has no experts"),
    (("routed_bias=false", "routed_bias_update_rate=0.001"), "routed_bias_update_rate=0.001: needs routed_bias=true"),
    (("routed_scaling_factor=0",), "routed_scaling_factor=0.0: must be > 0"),
    (("shared_experts=-1",), "shared_experts=-1: must be >= 0"),
])
def test_bad_deepseek_values_are_one_line_naming_the_key(overrides, message):
  base = tuple(o for o in DEEPSEEK if not o.startswith(("n_routing_groups", "topk_routing_group")))
  with pytest.raises(errors.ConfigError, match=message) as error:
    tiny_config(*base, *overrides, num_devices=1)
  assert "\n" not in str(error.value)
