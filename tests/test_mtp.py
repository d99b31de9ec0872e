"""DeepSeek-V3's multi-token prediction: the training loss and its gradients against a second pass
built by hand from the model's pieces (embedding lookup, norms, concatenation and projection in
jnp, the MTP layer's decoder layer through its own apply, the shared head, cross entropy with
targets and masks from numpy), untiled and vocabulary-tiled; mtp_num_layers=0 leaves the model as
it was; 8 devices against one; the prediction layers' routed bias; their FLOPs; Hugging Face
conversion of DeepSeek's prediction layer both ways; bad input."""

import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import BASE_YML, ROOT, assert_trees_close, loss_and_gradients_of, model_inputs, on_devices, tiny_config
from safetensors.numpy import load_file, save_file

from MaxText import costs, errors, objective, pyconfig
from MaxText.checkpoint_conversion import mapping, to_huggingface, to_maxtext
from MaxText.layers import decoders, moe, multi_token_prediction
from MaxText.layers.models import Transformer

# A tiny DeepSeek-V3 (its attention is any decoder layer's; grouped-query attention compiles
# fastest): one dense layer then experts with a shared expert and sigmoid routing,
# and two prediction depths. The router's losses are off so the loss is the cross entropies alone.
DEEPSEEK3 = ("decoder_block=deepseek", "logits_via_embedding=false", "num_experts=4", "num_experts_per_tok=2",
             "base_moe_mlp_dim=16", "first_num_dense_layers=1", "shared_experts=1", "routed_score_func=sigmoid",
             "routed_bias=true", "load_balance_loss_weight=0", "router_z_loss_weight=0")
MTP = (*DEEPSEEK3, "mtp_num_layers=2", "mtp_loss_scaling_factor=0.3")
RTOL = 1e-5


def packed_batch(cfg, rows):
  """model_inputs' two documents per row as the input pipeline packs them: a document's last
  token has no target (targets_segmentation 0), nor has the row's last."""
  tokens, positions, segments = model_inputs(cfg, batch=rows)
  following = np.roll(segments, -1, axis=1)
  scored = (following == segments) & (np.arange(tokens.shape[1]) < tokens.shape[1] - 1)
  return {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "inputs_position": positions,
          "inputs_segmentation": segments, "targets_segmentation": (segments * scored).astype(np.int32)}


def rms(x, scale, eps):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * scale


def cross_entropy(hidden, kernel, targets, mask):
  """sum over tokens of mask * -log softmax(hidden @ kernel)[target], and the mask's sum."""
  logp = jax.nn.log_softmax(hidden @ kernel, axis=-1)
  picked = jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
  return -jnp.sum(mask * picked), np.sum(mask)


def reference_loss(cfg, params, batch):
  """(main cross entropy sum, the MTP term it adds): the decoder through its own apply, then
  each prediction depth by hand. Depth k at position i embeds token i + k and predicts token
  i + k + 1, scored where that token exists and is in position i's document."""
  tokens, positions, segments = batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
  length, eps, kernel = tokens.shape[1], cfg.normalization_layer_epsilon, params["logits_kernel"]
  x = params["token_embedder"]["embedding"][tokens]
  normed, h = decoders.Decoder(cfg).apply({"params": params["decoder"]}, x, positions, segments)
  main, total = cross_entropy(normed, kernel, batch["targets"], batch["targets_segmentation"] != 0)
  depths = []
  for k in range(1, cfg.mtp_num_layers + 1):
    p = params["mtp"][f"layer_{k}"]
    ahead = jnp.pad(x[:, k:], [(0, 0), (0, k), (0, 0)])  # embedding of token i + k
    joined = jnp.concatenate([rms(ahead, p["embedding_norm"]["scale"], eps),
                              rms(h, p["hidden_state_norm"]["scale"], eps)], axis=-1)
    h = decoders.DecoderLayer(cfg, True).apply({"params": p["transformer_layer"]}, joined @ p["projection"],
                                               positions, segments, cfg.base_num_decoder_layers + k - 1)
    targets = np.pad(tokens[:, k + 1:], [(0, 0), (0, k + 1)])
    mask = np.zeros(tokens.shape, np.float32)
    for i in range(length - k - 1):
      mask[:, i] = segments[:, i + k + 1] == segments[:, i]
    ce, count = cross_entropy(rms(h, p["shared_head_norm"]["scale"], eps), kernel, targets, mask)
    depths.append(ce / count)
  return main, total * cfg.mtp_loss_scaling_factor * sum(depths) / len(depths)


@pytest.fixture(scope="module")
def reference():
  """The tiny model's config, parameters, batch, and the hand-built loss and gradients."""
  cfg = tiny_config(*MTP, num_devices=1)
  batch = packed_batch(cfg, cfg.global_batch_size_to_train_on)
  tokens = batch["inputs"]
  params = jax.device_get(nn.meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens, tokens,
                                                                       tokens)["params"]))

  def loss(p):
    parts = reference_loss(cfg, p, batch)
    return sum(parts), parts

  (_, (main, mtp)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return cfg, params, batch, float(main), float(mtp), grads


MESH = ("per_device_batch_size=0.5", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_data_parallelism=2")


# The tiled loss runs on 8 devices (the reference's 4 rows over fsdp x data): one compile proves
# tiling and the mesh, each of which would move the result past the tolerance if it were wrong.
@pytest.mark.parametrize("tiles, devices, mesh", [(1, 1, ()), (4, 8, MESH)],
                         ids=["untiled, one device", "4 tiles, fsdp 2 x tensor 2 x data 2"])
def test_mtp_loss_and_gradients_equal_a_second_pass_by_hand(reference, tiles, devices, mesh):
  cfg, params, batch, main, mtp, grads = reference
  assert mtp > 0.1 * main / np.sum(batch["targets_segmentation"] != 0)  # the depths are scored
  with on_devices(devices):
    loss, got = loss_and_gradients_of(tiny_config(*MTP, f"num_vocab_tiling={tiles}", *mesh), params, batch)
  np.testing.assert_allclose(loss, main + mtp, rtol=RTOL)
  assert_trees_close(got, grads, RTOL, f"num_vocab_tiling={tiles} on {devices} devices")


def test_the_prediction_layers_routed_bias_moves_by_their_own_load(reference):
  cfg, params, _, _, _, _ = reference
  load = np.array([3.0, 0.0, 1.0, 4.0], np.float32)
  sown = {"mtp": {f"layer_{k}": {"transformer_layer": {"moe_block": {moe.EXPERT_LOAD: (k * load,)}}}
                  for k in (1, 2)}}
  moved = moe.update_routed_bias(params, {"mtp": multi_token_prediction.expert_loads(cfg, sown)}, 0.01)
  for k in (1, 2):
    bias = lambda p, k=k: p["mtp"][f"layer_{k}"]["transformer_layer"]["moe_block"]["gate"]["bias"]
    np.testing.assert_allclose(bias(moved), bias(params) + 0.01 * np.sign(np.mean(k * load) - k * load), rtol=RTOL)
  assert moved["decoder"] is params["decoder"]


def test_without_mtp_the_parameters_and_loss_are_the_models_own(reference):
  cfg, params, batch, main, _, _ = reference
  off = tiny_config(*DEEPSEEK3, num_devices=1)
  tokens = batch["inputs"]
  tree = jax.eval_shape(lambda: Transformer(off).init(jax.random.key(0), tokens, tokens, tokens)["params"])
  without = {name: value for name, value in params.items() if name != "mtp"}
  assert jax.tree.structure(nn.meta.unbox(tree)) == jax.tree.structure(without)
  loss = jax.jit(lambda p: objective.batch_sums(Transformer(off), off, p, batch)[0])(without)
  np.testing.assert_allclose(loss, main, rtol=RTOL)


def test_evaluation_reports_the_main_loss_and_the_mtp_loss_beside_it(reference):
  cfg, params, batch, main, mtp, _ = reference
  loss, sums = jax.jit(lambda p: objective.batch_sums(Transformer(cfg), cfg, p, batch, train=False))(params)
  np.testing.assert_allclose(loss, main, rtol=RTOL)
  np.testing.assert_allclose(sums.metrics["mtp_loss"], mtp / cfg.mtp_loss_scaling_factor, rtol=RTOL)


def test_flops_count_each_prediction_layer_as_a_layer_plus_its_projection_and_head():
  """Two prediction depths cost two more MoE layers (as counted by one more decoder layer) and,
  per depth, the [2D, D] projection and the output head, forward and backward."""
  with_mtp, without = tiny_config(*MTP, num_devices=1), tiny_config(*DEEPSEEK3, num_devices=1)
  deeper = tiny_config(*DEEPSEEK3, "base_num_decoder_layers=3", num_devices=1)
  d, tokens = without.base_emb_dim, without.global_batch_size_to_train_on * without.max_target_length
  layer = costs.training_flops_per_step(deeper) - costs.training_flops_per_step(without)
  heads = 6 * tokens * (2 * d * d + d * without.vocab_size)
  assert costs.training_flops_per_step(with_mtp) - costs.training_flops_per_step(without) == pytest.approx(
      2 * (layer + heads), rel=1e-12)


def test_deepseeks_prediction_layer_converts_both_ways_bit_for_bit(tmp_path):
  """DeepSeek's layer after the last (here 4), written by numpy into the tiny DeepSeek-V3's
  directory: an MoE layer's tensors, its norms and eh_proj, and copies of the embedding and the
  head. Imported with mtp_num_layers=1 it is the model's mtp/layer_1 (eh_proj transposed, as it
  reads [enorm(embedding) ; hnorm(hidden)]); exported, every tensor comes back bit for bit."""
  hf = tmp_path / "hf"
  shutil.copytree(ROOT / "tests" / "assets" / "hf" / "deepseek3", hf)
  tensors = load_file(hf / "model.safetensors")
  rng = np.random.default_rng(0)
  layer = lambda name: "model.layers.4." + name
  mtp = {name.replace("model.layers.3.", "model.layers.4."): rng.standard_normal(t.shape).astype(t.dtype)
         for name, t in tensors.items() if name.startswith("model.layers.3.")}  # layer 3 has experts
  mtp.update({layer(name): rng.standard_normal(shape).astype(np.float32) for name, shape in [
      ("enorm.weight", (32,)), ("hnorm.weight", (32,)), ("eh_proj.weight", (32, 64)),
      ("shared_head.norm.weight", (32,))]})
  mtp.update({layer("embed_tokens.weight"): tensors["model.embed_tokens.weight"],
              layer("shared_head.head.weight"): tensors["lm_head.weight"]})
  save_file({**tensors, **mtp}, hf / "model.safetensors")
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={hf}", f"base_output_directory={tmp_path}", "run_name=a", "mtp_num_layers=1"]))
  params = ocp.PyTreeCheckpointer().restore(f"{converted}/state")["params"]
  config = pyconfig.initialize([BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}",
                                f"hf_output_path={tmp_path / 'exported'}"])
  tokens = np.zeros((1, config.max_target_length), np.int32)
  model = jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), tokens, tokens, tokens)["params"])
  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, nn.meta.unbox(model))
  predicted = params["mtp"]["layer_1"]
  np.testing.assert_array_equal(predicted["projection"], mtp[layer("eh_proj.weight")].T)
  np.testing.assert_array_equal(predicted["embedding_norm"]["scale"], mtp[layer("enorm.weight")])
  np.testing.assert_array_equal(predicted["transformer_layer"]["moe_block"]["wi_0"][1],
                                mtp[layer("mlp.experts.1.gate_proj.weight")].T)
  to_huggingface.convert(config)
  exported, wanted = load_file(tmp_path / "exported" / "model.safetensors"), {**tensors, **mtp}
  assert sorted(exported) == sorted(wanted) and all(np.array_equal(exported[n], wanted[n]) for n in wanted)


@pytest.mark.parametrize("override, message", [("mtp_num_layers=-1", "mtp_num_layers=-1: must be >= 0"),
                                               ("mtp_loss_scaling_factor=-0.1",
                                                "mtp_loss_scaling_factor=-0.1: must be >= 0")])
def test_bad_mtp_values_are_one_line_naming_the_key(override, message):
  with pytest.raises(errors.ConfigError, match=message) as error:
    tiny_config(*DEEPSEEK3, override, num_devices=1)
  assert "\n" not in str(error.value)
