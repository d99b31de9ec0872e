"""Config: layering, typing, derived values, and one-line errors with exit code 2."""

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml
from conftest import BASE_YML, ROOT, TINY, run_cli, tiny_config

from MaxText import config_reference, config_schema, errors, launch, pyconfig, sharding


def test_overrides_are_parsed_to_the_type_of_the_default():
  cfg = tiny_config("learning_rate=1", "scan_layers=false", "run_name=x", "steps=7", "adam_eps=1e-6",
                    'logical_axis_rules=[["vocab", ["tensor"]]]')
  assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
  assert cfg.scan_layers is False and cfg.steps == 7 and cfg.run_name == "x" and cfg.adam_eps == 1e-6
  assert cfg.logical_axis_rules == (("vocab", ("tensor",)),)


def test_an_axis_rule_of_one_axis_or_none_reads_as_its_list():
  """["mlp", "tensor"] and ["mlp", null] are the rules ["mlp", ["tensor"]] and ["mlp", []]: the
  divisibility check, the shard counts and flax's rules all see the same."""
  short = tiny_config("ici_tensor_parallelism=2", "ici_fsdp_parallelism=1", "base_mlp_dim=66",
                      'logical_axis_rules=[["mlp", "tensor"], ["vocab", null]]', num_devices=2)
  assert short.logical_axis_rules == (("mlp", ("tensor",)), ("vocab", ()))
  assert sharding.axis_rules(short) == (("mlp", ("tensor",)), ("vocab", None))
  with pytest.raises(errors.ConfigError, match=r"base_mlp_dim=65: not divisible by .* tensor \(2\)"):
    tiny_config("ici_tensor_parallelism=2", "ici_fsdp_parallelism=1", "base_mlp_dim=65",
                'logical_axis_rules=[["mlp", "tensor"]]', num_devices=2)


def test_model_name_layers_the_model_file_over_base_and_cli_wins():
  cfg = pyconfig.initialize([BASE_YML, "model_name=llama3-8b", "base_num_decoder_layers=2"], num_devices=1)
  assert (cfg.vocab_size, cfg.base_num_kv_heads, cfg.rope_max_timescale) == (128256, 8, 500000)
  assert cfg.base_num_decoder_layers == 2


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.yml")))
def test_every_model_config_resolves_and_its_model_traces(name):
  """Each model file: valid keys and values, and a model whose parameters have the shapes the
  file describes (traced abstractly: nothing is allocated)."""
  import jax

  from MaxText.layers import decoders
  from MaxText.layers.models import Transformer
  cfg = pyconfig.initialize([BASE_YML, f"model_name={name}", "dataset_type=synthetic"], num_devices=1)
  def init():
    tokens = jax.numpy.zeros((1, cfg.max_target_length), "int32")
    return Transformer(cfg).init(jax.random.key(0), tokens, tokens, tokens)["params"]

  params = jax.eval_shape(init)
  positions = [(stack, j, kind) for stack in decoders.stacks(cfg) for j, kind in enumerate(stack.block)]
  for stack, j, kind in positions:  # a block of K kinds stores each position's layers apart
    layers = params["decoder"][stack.name] if len(stack.block) == 1 else params["decoder"][stack.name][f"layer_{j}"]
    depth = stack.depth // len(stack.block)
    if kind.moe:
      assert layers["moe_block"]["wi_0"].value.shape == (depth, cfg.num_experts, cfg.base_emb_dim,
                                                         cfg.base_moe_mlp_dim)
      assert layers["moe_block"]["gate"]["kernel"].value.shape[1:] == (cfg.base_emb_dim, cfg.num_experts)
    else:
      assert layers["mlp"]["wi_0"]["kernel"].value.shape == (depth, cfg.base_emb_dim, cfg.base_mlp_dim)
    assert ("pre_self_attention_norm" in layers) == (cfg.decoder_block != "olmo3")
    if kind.mixer == "gated_delta_net":
      linear, groups = layers["linear_attention"], cfg.gdn_num_value_heads // cfg.gdn_num_key_heads
      per_key_head = 2 * cfg.gdn_key_head_dim + 2 * groups * cfg.gdn_value_head_dim
      assert linear["in_proj_qkvz"]["kernel"].value.shape == (depth, cfg.base_emb_dim, cfg.gdn_num_key_heads,
                                                               per_key_head)
      assert linear["out_proj"]["kernel"].value.shape == (depth, cfg.gdn_num_value_heads, cfg.gdn_value_head_dim,
                                                           cfg.base_emb_dim)
      continue
    attention = layers["self_attention"]
    if cfg.attention_type == "mla":
      assert attention["wkv_b"]["kernel"].value.shape[1:] == (cfg.kv_lora_rank, cfg.base_num_query_heads,
                                                              cfg.qk_nope_head_dim + cfg.v_head_dim)
    else:
      assert attention["key"]["kernel"].value.shape[2:] == (cfg.base_num_kv_heads, cfg.head_dim)
      # With the output gate (Qwen3-Next) the query kernel holds each head's queries, then its gates.
      gated = 2 if cfg.attention_output_gate else 1
      assert attention["query"]["kernel"].value.shape[2:] == (cfg.base_num_query_heads, gated * cfg.head_dim)
    assert ("query_norm" in attention) == (cfg.decoder_block in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3", "olmo3"))
    if cfg.decoder_block == "olmo3":  # over the whole projections
      assert attention["key_norm"]["scale"].value.shape[1:] == (cfg.base_num_kv_heads * cfg.head_dim,)
    assert ("post_ffw_norm" in layers) == (cfg.decoder_block in ("gemma2", "gemma3", "olmo3"))
  assert sum(stack.depth for stack in decoders.stacks(cfg)) == cfg.base_num_decoder_layers
  assert ("logits_kernel" in params) == (not cfg.logits_via_embedding)


def test_derived_values():
  cfg = tiny_config("per_device_batch_size=3", "gradient_accumulation_steps=2", "head_dim=null",
                    "base_emb_dim=48", num_devices=4)
  assert cfg.micro_batch_size == 12 and cfg.global_batch_size_to_train_on == 24
  assert cfg.head_dim == 12 and cfg.mesh_shape == (1, 1, 4, 1, 1, 1)
  assert cfg.learning_rate_schedule_steps == cfg.steps
  cfg = tiny_config("ici_tensor_parallelism=2", "ici_data_parallelism=2", num_devices=8)
  assert cfg.mesh_shape == (2, 1, 2, 2, 1, 1)


def test_config_is_read_only():
  cfg = tiny_config()
  with pytest.raises(AttributeError):
    cfg.steps = 3


@pytest.mark.parametrize("override, key", [
    ("no_such_key=1", "no_such_key"),
    ("steps=abc", "steps"),
    ("steps=1.5", "steps"),
    ("scan_layers=maybe", "scan_layers"),
    ("learning_rate=fast", "learning_rate"),
    ("per_device_batch_size=-1", "per_device_batch_size"),
    ("per_device_batch_size=0.3", "per_device_batch_size"),
    ("base_num_kv_heads=3", "base_num_kv_heads"),
    ("steps=0", "steps"),
    ("dtype=float8", "dtype"),
    ("head_dim=7", "head_dim"),
    ("adam_b2=1.0", "adam_b2"),
    ("warmup_steps_fraction=1.5", "warmup_steps_fraction"),
    ("gradient_accumulation_steps=0", "gradient_accumulation_steps"),
    ("model_name=gpt5", "model_name"),
    ("ici_fsdp_parallelism=3", "ici_"),
    ("ici_tensor_parallelism=-1", "ici_"),
    ("logical_axis_rules=[[\"vocab\",[\"model\"]]]", "logical_axis_rules"),
    ("remat_policy=most", "remat_policy"),
    ("remat_layer_interval=0", "remat_layer_interval"),
    ("remat_layer_interval=3", "remat_layer_interval"),
    ("query_proj=keep", "query_proj"),
    ("num_vocab_tiling=0", "num_vocab_tiling"),
    ("num_vocab_tiling=65", "num_vocab_tiling"),
    ("vocab_tiling_mode=magic", "vocab_tiling_mode"),
    ("noequals", "noequals"),
    ("eval_steps=0", "eval_steps"),
    ("learning_rate=inf", "learning_rate"),
    ("adam_eps=nan", "adam_eps"),
    ("z_loss_multiplier=-inf", "z_loss_multiplier"),
    ("learning_rate_schedule_steps=4", "learning_rate_schedule_steps"),
    ("max_nonfinite_steps=0", "max_nonfinite_steps"),
    ("run_name=../other", "run_name"),
    ("run_name=/tmp/elsewhere", "run_name"),
    ("run_name=..", "run_name"),
    ("decoder_block=gemma4", "decoder_block"),
    ("attn_logits_soft_cap=-1", "attn_logits_soft_cap"),
    ("query_pre_attn_scalar=-1", "query_pre_attn_scalar"),
    ("sliding_window_size=-1", "sliding_window_size"),
    ("local_rope_max_timescale=-1", "local_rope_max_timescale"),
    ("rope_linear_scaling_factor=0", "rope_linear_scaling_factor"),
    ("steps=10000000000", "steps"),
    ("vocab_size=4e9", "vocab_size"),
    ('logical_axis_rules=[["embed", ["fsdp", "fsdp"]]]', "logical_axis_rules"),
    ("mlp_chunks=0", "mlp_chunks"),
    ("mlp_chunks=3", "mlp_chunks"),
    ("attention_head_chunks=0", "attention_head_chunks"),
    ("attention_head_chunks=3", "attention_head_chunks"),
])
def test_bad_values_name_the_key(override, key):
  with pytest.raises(errors.ConfigError, match=key):
    tiny_config(override, num_devices=1)


@pytest.mark.parametrize("overrides, message", [
    # TINY: 4 query heads, 2 kv heads, MLP 64, vocabulary 128, width 32, 16 tokens, 4 rows per device.
    (("ici_tensor_parallelism=4", "ici_fsdp_parallelism=2"), "base_num_kv_heads=2: not divisible by .* tensor \\(4\\)"),
    (("ici_tensor_parallelism=8", "ici_fsdp_parallelism=1"), "base_num_query_heads=4: .* tensor \\(8\\)"),
    (("ici_context_parallelism=8", "ici_fsdp_parallelism=1", "max_target_length=20"),
     "max_target_length=20: .* context"),
    (("ici_fsdp_parallelism=8", "per_device_batch_size=0.5"), "rows per step .*=4: .* fsdp \\(8\\)"),
    (("ici_fsdp_parallelism=8", "base_emb_dim=36", "head_dim=8"), "base_emb_dim=36: .* fsdp \\(8\\)"),
    (("ici_tensor_parallelism=8", "ici_fsdp_parallelism=1", "base_num_query_heads=8", "base_num_kv_heads=8",
      "vocab_size=300"), "vocab_size=300: .* tensor \\(8\\)"),
    (("mlp_chunks=128",), "mlp_chunks=128: must divide the 64 hidden units per tensor shard"),
    (("ici_tensor_parallelism=2", "ici_fsdp_parallelism=4", "mlp_chunks=64"),
     "mlp_chunks=64: must divide the 32 hidden units per tensor shard"),
    (("decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24", "mlp_chunks=16"),
     "mlp_chunks=16: must divide the 24 hidden units per tensor shard \\(base_moe_mlp_dim"),
    (("ici_tensor_parallelism=2", "ici_fsdp_parallelism=4", "attention_head_chunks=2"),
     "attention_head_chunks=2: must divide the 1 key/value heads per tensor shard"),
])
def test_a_mesh_that_does_not_divide_a_dimension_is_a_config_error(overrides, message):
  with pytest.raises(errors.ConfigError, match=message):
    tiny_config(*overrides, num_devices=8)


def test_offload_policy_needs_host_memory():
  assert tiny_config("remat_policy=minimal_offloaded", memory_kinds=["device", "pinned_host"])
  with pytest.raises(errors.ConfigError, match="remat_policy"):
    tiny_config("remat_policy=qkv_proj_offloaded", memory_kinds=["device"])
  with pytest.raises(errors.ConfigError, match="remat_policy"):
    tiny_config("remat_policy=custom", "mlpwo=offload", memory_kinds=["device"])


def test_missing_config_file():
  with pytest.raises(errors.ConfigError, match="no_such.yml"):
    pyconfig.initialize(["configs/no_such.yml"], num_devices=1)


@pytest.mark.parametrize("args", [("no_such_key=1",), ("per_device_batch_size=-1",), ("mlp_chunks=5",)])
def test_cli_config_error_is_one_line_exit_2_and_writes_nothing(tmp_path, args):
  out = tmp_path / "outputs"
  result = run_cli("train", f"base_output_directory={out}", *args)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
  assert args[0].split("=")[0] in lines[0]
  assert not out.exists()


def test_cli_missing_config_file_exits_2(tmp_path):
  result = subprocess.run([sys.executable, "-m", "MaxText.train_compile", str(tmp_path / "x.yml")],
                          capture_output=True, text=True)
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
  assert "x.yml" in result.stderr


@pytest.mark.parametrize("edit, message", [
    (("steps: 300", 'steps: "ten"'), "steps=ten: must be an integer"),
    (("num_vocab_tiling: 1", "num_vocab_tiling: 1.5"), "num_vocab_tiling=1.5: must be an integer or one of auto"),
    (("vocab_size: 4096", "vocab_size: 4000000000"), "vocab_size=4000000000: must be at most"),
])
def test_a_config_files_values_are_typed_like_the_command_line(tmp_path, edit, message):
  path = tmp_path / "copy.yml"
  text = open(BASE_YML).read()
  assert edit[0] in text
  path.write_text(text.replace(edit[0], edit[1]))
  with pytest.raises(errors.ConfigError, match=re.escape(message)):
    pyconfig.initialize([str(path)], num_devices=1)


def test_a_config_file_and_the_command_line_type_a_value_by_one_rule(tmp_path):
  """YAML 1.1 would read `yes` as a bool and `2024` as a number; the config is typed as the
  command line is, and a user's config outside configs/ names the project's model files."""
  path = tmp_path / "mine.yml"
  path.write_text(f"base_config: {BASE_YML}\nrun_name: 2024\nmodel_name: llama2-7b\n"
                  'logical_axis_rules: [["vocab", null]]\n')
  from_file = pyconfig.initialize([str(path), "dataset_type=synthetic"], num_devices=1)
  from_cli = pyconfig.initialize([BASE_YML, "dataset_type=synthetic", "run_name=2024", "model_name=llama2-7b",
                                  'logical_axis_rules=[["vocab", null]]'], num_devices=1)
  assert from_file.to_dict() == from_cli.to_dict() and from_file.run_name == "2024"
  assert from_file.base_emb_dim == 4096 and from_file.logical_axis_rules == (("vocab", ()),)
  path.write_text(f"base_config: {BASE_YML}\nscan_layers: yes\n")
  with pytest.raises(errors.ConfigError, match=re.escape("scan_layers=yes: must be a bool (true/false)")):
    pyconfig.initialize([str(path)], num_devices=1)
  with pytest.raises(errors.ConfigError, match=re.escape("scan_layers=yes: must be a bool (true/false)")):
    pyconfig.initialize([BASE_YML, "scan_layers=yes"], num_devices=1)


@pytest.mark.parametrize("text", ["", "steps: 5\n"], ids=["empty", "partial"])
def test_a_config_file_without_every_key_says_so_and_base_config_fills_them(tmp_path, text):
  path = tmp_path / "mine.yml"
  path.write_text(text)
  with pytest.raises(errors.ConfigError, match=re.escape(f"config file '{path}' lacks") + ".*base_config"):
    pyconfig.initialize([str(path)], num_devices=1)
  path.write_text(f"base_config: {BASE_YML}\n{text}")
  config = pyconfig.initialize([str(path), "vocab_size=320"], num_devices=1)
  assert config.steps == (5 if text else 300) and config.vocab_size == 320
  path.write_text(f"base_config: {BASE_YML}\nsteps: ten\n")
  with pytest.raises(errors.ConfigError, match="steps=ten"):
    pyconfig.initialize([str(path)], num_devices=1)


def test_cli_empty_config_file_is_one_line_exit_2(tmp_path):
  (tmp_path / "empty.yml").write_text("")
  result = subprocess.run([sys.executable, "-m", "MaxText.train", str(tmp_path / "empty.yml")],
                          capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
  assert "lacks" in result.stderr and "Traceback" not in result.stderr


def test_base_yml_and_the_config_reference_are_what_the_schema_writes():
  """configs/base.yml and docs/reference/config.md are written from config_schema's sections
  (`python -m MaxText.config_reference` rewrites both); base.yml reads back as the defaults, and
  every key has a description and belongs to one section."""
  assert open(BASE_YML).read() == config_reference.base_yml(), "configs/base.yml is stale"
  assert (ROOT / "docs" / "reference" / "config.md").read_text() == config_reference.markdown(), \
      "docs/reference/config.md is stale"
  assert pyconfig.load_yaml(BASE_YML, yaml.SafeLoader) == pyconfig.defaults()
  keys = [f for s in config_schema.SECTIONS for f in dataclasses.fields(s)]
  assert len({f.name for f in keys}) == len(keys)
  assert [f.name for f in keys if not f.metadata["help"]] == []


def test_unset_is_null_and_auto_is_a_value():
  config = tiny_config("head_dim=null", "learning_rate_schedule_steps=null", "capacity_factor=null", num_devices=1)
  assert (config.head_dim, config.learning_rate_schedule_steps, config.capacity_factor) == (8, config.steps, None)
  values, auto = pyconfig.parse([BASE_YML, *TINY, "num_vocab_tiling=auto", "remat_policy=auto"])
  assert auto == ("remat_policy", "num_vocab_tiling")
  assert (values["num_vocab_tiling"], values["remat_policy"]) == (1, "full")  # the defaults, until planned
  with pytest.raises(errors.ConfigError, match="num_vocab_tiling=auto: only train and train_compile"):
    tiny_config("num_vocab_tiling=auto", num_devices=1)
  for bad in ("head_dim=0", "capacity_factor=-1", "hbm_budget_gib=0"):
    with pytest.raises(errors.ConfigError, match=f"{bad.split('=')[0]}=.*null"):
      tiny_config(bad, num_devices=1)


def test_parsing_reads_no_checkpoint_and_starts_no_backend(tmp_path):
  """pyconfig.parse is pure: a checkpoint without checksums and JAX's backends are the entry
  point's (launch.config), in a fresh interpreter."""
  step = tmp_path / "run" / "checkpoints" / "3"
  step.mkdir(parents=True)
  script = ("import sys; from MaxText import pyconfig; from jax._src import xla_bridge; "
            f"pyconfig.parse([{BASE_YML!r}, 'load_parameters_path={step}']); "
            "sys.exit(3 if xla_bridge._backends else 0)")
  assert subprocess.run([sys.executable, "-c", script], cwd=ROOT).returncode == 0
  with pytest.raises(errors.ConfigError, match="checksums"):
    launch.config([BASE_YML, *TINY, f"load_parameters_path={step}"])
