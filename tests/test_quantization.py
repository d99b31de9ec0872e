"""Low-precision matmuls (quantization=int8|fp8|fp8_full): the one seam quantizes as a NumPy
per-channel absmax reference does; a layer's seven projections run on int8 operands forward and
in both backward products; the experts' grouped matmuls in fp8 too; quantized runs train close
to the unquantized one; bad settings are one line and a resume that changes it says so."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  BASE_YML,
  assert_trees_close,
  fixed_batch,
  loss_gradients,
  metrics_losses,
  tiny_config,
  trainer_and_state,
)

from MaxText import accelerators, costs, errors, objective, pyconfig, run_control, sharding, train, train_step
from MaxText.layers import linears

MOE = ("decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32")


def numpy_int8(x, axis):
  """Symmetric int8 with one absmax scale per slice along `axis` (qwix's: absmax / 127.5, rounded
  half to even, saturated) -> (values, scales)."""
  scale = np.max(np.abs(x), axis=axis, keepdims=True) / 127.5
  return np.clip(np.round(x / scale), -128, 127), scale


def largest_positive(x, axis):
  """x with each slice along `axis` signed so its largest magnitude is positive: that value is
  then 127.5 scales, which rounds to the saturated 127 whichever way the division rounds."""
  top = np.take_along_axis(x, np.argmax(np.abs(x), axis=axis, keepdims=True), axis=axis)
  return x * np.sign(top)


def test_the_seam_quantizes_each_activation_row_and_weight_column_as_numpy_does():
  rng = np.random.default_rng(0)
  x = largest_positive(rng.normal(size=(2, 5, 16)).astype(np.float32), axis=2)
  w = largest_positive(rng.normal(size=(16, 3, 4)).astype(np.float32), axis=0)
  qx, sx = numpy_int8(x, axis=2)  # per token, over the contracted width
  qw, sw = numpy_int8(w, axis=0)  # per output feature
  want = np.einsum("btd,dnh->btnh", qx, qw) * sx[..., None] * sw[None]
  got = linears.matmul(tiny_config("quantization=int8"), "btd,dnh->btnh", jnp.asarray(x), jnp.asarray(w))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  exact = np.einsum("btd,dnh->btnh", x, w)
  assert 0 < np.abs(got - exact).max() < 0.05 * np.abs(exact).max()  # quantized, and close


def compiled_step_text(*overrides):
  config = tiny_config("per_device_batch_size=2", "base_num_decoder_layers=1", *overrides)
  trainer, state = trainer_and_state(config)
  loss = lambda p, b: objective.batch_sums(trainer.model, config, p, b)[0]
  with sharding.activate(trainer.mesh, config):
    batch = train_step.device_batch(trainer, fixed_batch(config))
    return jax.jit(jax.grad(loss)).lower(state.params, batch).compile().as_text()


def layer_dots(hlo: str) -> list:
  """(result type, JAX operation) of each dot of the compiled HLO in the layer body (an int8
  product accumulates in s32); the attention's own products (scores, context) left out."""
  found = []
  for line in hlo.splitlines():
    match = re.search(r"= (\w+)\[\S* dot\(.*op_name=\"([^\"]*)\"", line)
    if match and "decoder/layers/while/body" in match[2] and not re.search(r"BTNH|BNTS", match[2]):
      found.append(match.groups())
  return found


def test_int8_runs_the_layers_seven_projections_forward_and_both_backward_products_on_int8():
  """q, k, v, out and the MLP's three: forward and the activations' and the weight's gradient
  products (21), and what remat_policy=full recomputes of the forward, all on int8 operands; the
  unquantized step's the same products in float32."""
  hlo = compiled_step_text("quantization=int8", "quantization_local_shard_count=1")
  quantized = layer_dots(hlo)
  assert len(quantized) >= 21 and all(result == "s32" for result, _ in quantized), quantized
  plain = compiled_step_text()
  assert len(layer_dots(plain)) == len(quantized) and all(result == "f32" for result, _ in layer_dots(plain))
  # The cost model's count of the compiled products by operand types (train_compile prints it).
  assert costs.compiled_products(hlo)["s8 x s8"] == len(quantized) and "s8 x s8" not in costs.compiled_products(plain)


def equations(jaxpr):
  """Every equation of a jaxpr, those of the jaxprs inside its equations' parameters too."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for inner in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from equations(inner)


@pytest.mark.parametrize("quantization", ["fp8", "fp8_full"])
def test_fp8_quantizes_the_experts_grouped_matmuls_too(quantization):
  """fp8_full's gradients in e5m2; both recipes' experts' products take fp8 operands."""
  config = tiny_config("per_device_batch_size=2", "base_num_decoder_layers=1", *MOE, f"quantization={quantization}")
  trainer, state = trainer_and_state(config)
  with sharding.activate(trainer.mesh, config):
    batch = train_step.device_batch(trainer, fixed_batch(config))
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: objective.batch_sums(trainer.model, config, p, batch)[0]))(
        state.params)
  # Each grouped product's operand types: the three projections forward (twice: recomputed under
  # remat_policy=full) and each one's two backward products, one operand the incoming gradient.
  types = [tuple(str(v.aval.dtype) for v in eqn.invars[:2]) for eqn in equations(jaxpr.jaxpr)
           if eqn.primitive.name == "ragged_dot_general"]
  gradient = {"fp8": "float8_e4m3fn", "fp8_full": "float8_e5m2"}[quantization]
  assert len(types) == 12 and all(set(t) <= {"float8_e4m3fn", gradient} for t in types), types
  assert sum(gradient in t for t in types) == (12 if quantization == "fp8" else 6), types


def training_losses(tmp_path, name, *overrides):
  metrics = tmp_path / f"{name}.jsonl"
  train.train(tiny_config(f"base_output_directory={tmp_path}", f"run_name={name}", f"metrics_file={metrics}",
                          "steps=8", "learning_rate=1e-2", *overrides))
  return metrics_losses(metrics)


def test_quantized_runs_train_as_the_unquantized_one_does(tmp_path):
  """8 steps of the tiny model: int8's losses within 2% of the unquantized run's at every step,
  falling as far; fp8_full's of a mixture of experts within 2% of its unquantized run's (fp8's
  grouped products: test_fp8_quantizes_the_experts_grouped_matmuls_too)."""
  plain = training_losses(tmp_path, "plain")
  int8 = training_losses(tmp_path, "int8", "quantization=int8")
  np.testing.assert_allclose([int8[s] for s in sorted(plain)], [plain[s] for s in sorted(plain)], rtol=0.02)
  # ... and it learns as much: the drop over the run within a tenth of the unquantized one's.
  np.testing.assert_allclose(int8[1] - int8[8], plain[1] - plain[8], rtol=0.1)
  moe = training_losses(tmp_path, "moe", *MOE)
  fp8 = training_losses(tmp_path, "fp8_full", *MOE, "quantization=fp8_full")
  np.testing.assert_allclose([fp8[s] for s in sorted(moe)], [moe[s] for s in sorted(moe)], rtol=0.02)


def test_an_unknown_quantization_is_one_line_naming_the_choices():
  with pytest.raises(errors.ConfigError, match=r"^quantization=int4: must be one of '', int8, fp8, fp8_full$"):
    pyconfig.initialize([BASE_YML, "quantization=int4"])


def test_a_resume_with_another_quantization_says_so(tmp_path, caplog):
  (tmp_path / "default").mkdir()  # made by run_lock in a run
  run_control.record_run_files(tiny_config(f"base_output_directory={tmp_path}"), None)
  with caplog.at_level(logging.WARNING):
    run_control.record_run_files(tiny_config(f"base_output_directory={tmp_path}", "quantization=int8"), None)
  assert "trained with quantization='' and resumes with 'int8'" in caplog.text


def test_quantized_gradients_are_close_to_the_exact_ones():
  """int8 through the whole backward: the loss within 1% and each gradient's direction within a
  few degrees of the unquantized ones (a sign flip or a dropped product would be far off)."""
  exact = loss_gradients(tiny_config())
  quantized = loss_gradients(tiny_config("quantization=int8"))
  np.testing.assert_allclose(quantized["loss"], exact["loss"], rtol=0.01)
  for path, g in exact.items():
    if path != "loss" and np.linalg.norm(g) > 0:
      q = quantized[path]
      cosine = np.sum(g * q) / (np.linalg.norm(g) * np.linalg.norm(q))
      assert cosine > 0.99, (path, cosine)


def test_the_cost_model_splits_the_traced_flops_by_precision_and_bounds_the_step_by_each_peak():
  """The int8 step's products are the unquantized step's, those of the projections now counted as
  int8; on a v5p (int8 at twice bfloat16's rate) the bound on the step is each part at its peak."""
  def split(*overrides):
    config = tiny_config("per_device_batch_size=2", *overrides)
    trainer, _ = trainer_and_state(config)
    return costs.flops_by_precision(train_step.trace_train_step(trainer, config).jaxpr)

  plain, quantized = split(), split("quantization=int8")
  assert set(plain) == {"bf16"} and set(quantized) == {"bf16", "int8"} and quantized["int8"] > 0
  np.testing.assert_allclose(sum(quantized.values()), plain["bf16"], rtol=1e-12)
  v5p = accelerators.CHIPS["v5p"]
  np.testing.assert_allclose(costs.seconds_at_peak(quantized, v5p, 4),
                             (quantized["bf16"] / 459 + quantized["int8"] / 918) / 4 / 1e12, rtol=1e-12)



def test_skipped_layers_stay_unquantized_scanned_or_looped():
  """quantization_skip_layers: every layer skipped is the unquantized model; the first and the last
  of four skipped ([0, -1]) differ from both, and the scan (its layer traced: lax.cond) agrees with
  the Python loop (its layer known)."""
  four = ("base_num_decoder_layers=4", "quantization=int8")
  plain = loss_gradients(tiny_config("base_num_decoder_layers=4"))
  every = loss_gradients(tiny_config(*four, "quantization_skip_layers=[0,1,2,3]"))
  assert_trees_close(every, plain, rtol=1e-6)
  ends = loss_gradients(tiny_config(*four, "quantization_skip_layers=[0,-1]"))
  looped = loss_gradients(tiny_config(*four, "quantization_skip_layers=[0,-1]", "scan_layers=false"))
  assert_trees_close(looped, ends, rtol=1e-5)
  quantized = loss_gradients(tiny_config(*four))
  assert len({float(plain["loss"]), float(ends["loss"]), float(quantized["loss"])}) == 3


@pytest.mark.parametrize("overrides, message", [
    (("quantization_skip_layers=[0]",), "quantization_skip_layers=[0]: keeps layers out of quantization: set "
                                        "quantization"),
    (("quantization=int8", "quantization_skip_layers=[2]"), "quantization_skip_layers=[2]: names layers in [-2, 2)")])
def test_bad_skipped_layers_are_one_line(overrides, message):
  with pytest.raises(errors.ConfigError, match=re.escape(message)):
    tiny_config(*overrides)
