"""The memory planner (MaxText.plan) and `auto` keys, on tiny models."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import BASE_YML, TINY, metrics_losses, on_devices, run_cli

from MaxText import auto, costs, errors, launch, plan, pyconfig, remat, sharding, train

# Head-heavy: 2048-token vocabulary, 32 positions, so vocabulary tiling changes the memory.
HEAD_HEAVY = (*TINY, "vocab_size=2048", "max_target_length=32")
SEARCH = ("plan_remat_policies=[none,full]", "plan_remat_layer_intervals=[1]", "plan_per_device_batch_sizes=[2,4]",
          "plan_num_vocab_tiling=[1,4]")


def _argv(*overrides):
  return [BASE_YML, *HEAD_HEAVY, *overrides]


@pytest.fixture(scope="module")
def searched():
  """(records, budget): the pruned search, with the budget set to what full remat needs at
  batch 4 untiled, so the ladders stop inside the search space."""
  search = (*SEARCH, "plan_per_device_batch_sizes=[2,4,8,16]")
  config = pyconfig.initialize(_argv(*search))
  device = sharding.run_devices("", 1)[0]
  rates = plan.roofline_rates(device)
  reference = plan.evaluate(config, {"remat_policy": "full", "per_device_batch_size": 4, "num_vocab_tiling": 1}, rates)
  budget = reference["total_bytes"]
  free = ("remat_policy", "per_device_batch_size", "num_vocab_tiling")
  return plan.search(config, plan.search_space(config, free), budget, rates, workers=1), budget


@pytest.mark.slow
def test_the_search_stops_each_ladder_where_the_issue_says(searched):
  records, budget = searched
  ladder = [2, 4, 8, 16]
  chains = {}
  for r in records:
    chains.setdefault(r["settings"]["remat_policy"], []).append(r)
  assert set(chains) == {"none", "full"}
  for chain in chains.values():
    batches = sorted({r["settings"]["per_device_batch_size"] for r in chain})
    for batch in batches:
      tried = [r for r in chain if r["settings"]["per_device_batch_size"] == batch]
      fitting = [r["settings"]["num_vocab_tiling"] for r in tried if r["fits"]]
      # no more tiles are compiled once the fewest that fit are known
      assert fitting in ([], [tried[-1]["settings"]["num_vocab_tiling"]])
      # a setting that fits at no tile count is not tried at a larger batch
      if not fitting:
        assert batch == batches[-1]
    assert all(r["fits"] == (r["total_bytes"] <= budget) for r in chain)
  # the budget stops a ladder inside the search space, so the rule above is exercised
  assert any(max(r["settings"]["per_device_batch_size"] for r in chain) < ladder[-1] for chain in chains.values())


def test_the_choice_is_the_fastest_prediction_that_fits(searched):
  records, budget = searched
  chosen = plan.choose(records, budget, "test")
  assert chosen["fits"]
  faster = [r for r in records if r["status"] == "ok"
            and r["tokens_per_second_per_chip"] > chosen["tokens_per_second_per_chip"]]
  assert all(not r["fits"] for r in faster)
  assert chosen["tokens_per_step"] == chosen["settings"]["per_device_batch_size"] * 32
  # recomputation: full remat executes more matmul FLOPs than the model's, none no fewer
  by_policy = {r["settings"]["remat_policy"]: r["recompute_ratio"] for r in records if r["status"] == "ok"}
  assert by_policy["full"] > by_policy["none"] >= 1.0


def test_predicted_memory_equals_train_compiles(searched, tmp_path):
  records, budget = searched
  chosen = plan.choose(records, budget, "test")
  stats_file = tmp_path / "memory.json"
  result = run_cli("train_compile", *HEAD_HEAVY, *plan._assignments(chosen["settings"]),
                   f"memory_stats_file={stats_file}")
  assert result.returncode == 0, result.stderr[-3000:]
  stats = json.loads(stats_file.read_text())
  assert {k: stats[k] for k in ("temp_bytes", "total_bytes")} == {k: chosen[k] for k in ("temp_bytes", "total_bytes")}


def test_plan_exits_2_naming_the_smallest_when_the_budget_is_below_every_candidate(tmp_path):
  result = run_cli("plan", *HEAD_HEAVY, *SEARCH, "plan_per_device_batch_sizes=[2]", "plan_remat_policies=[full]",
                   "hbm_budget_gib=0.0001", f"base_output_directory={tmp_path}")
  assert result.returncode == 2, result.stderr[-3000:]
  assert len(result.stderr.strip().splitlines()) == 1
  assert result.stderr.startswith("config error: hbm_budget_gib: the budget of 0.0001 GiB per device")
  assert "is below every candidate; the smallest found needs" in result.stderr and "remat_policy=full" in result.stderr
  assert not list(tmp_path.iterdir())


def test_plan_into_an_unwritable_output_directory_is_one_line_before_any_compile(tmp_path, monkeypatch):
  (tmp_path / "default").write_text("a file where the run directory goes")
  monkeypatch.setattr(plan, "search", lambda *args, **kwargs: pytest.fail("compiled before checking the output"))
  with pytest.raises(errors.ConfigError, match="base_output_directory"):
    plan.main(["plan", BASE_YML, *HEAD_HEAVY, *SEARCH, f"base_output_directory={tmp_path}"])


def test_the_smallest_candidate_is_named_with_its_size_however_small():
  record = {"status": "ok", "fits": False, "total_bytes": 3 * 2**20, "settings": {"num_vocab_tiling": 1}}
  with pytest.raises(errors.ConfigError, match=r"smallest found needs 0\.00293 GiB per device \(num_vocab_tiling=1\)"):
    plan.choose([record], 2**20, "test")


def test_auto_resolves_once_per_fingerprint_and_reuses_it(tmp_path, monkeypatch):
  argv = _argv(f"base_output_directory={tmp_path}", *SEARCH, "num_vocab_tiling=auto", "per_device_batch_size=auto")
  config = launch.config(argv, plans=True)
  decision = json.loads((tmp_path / "default" / auto.CACHE_FILE).read_text())
  assert set(decision["settings"]) == {"num_vocab_tiling", "per_device_batch_size"}
  # The config resolved in place is the one the chosen settings give on the command line.
  explicit = [a for a in argv if not a.endswith("=auto")] + plan._assignments(decision["settings"])
  assert config.to_dict() == pyconfig.initialize(explicit).to_dict()

  def no_search(*args, **kwargs):
    raise AssertionError("searched again")

  monkeypatch.setattr(plan, "search", no_search)
  # A resumed run with more steps reuses the decision...
  resumed = launch.config([*argv, "steps=9"], plans=True)
  assert resumed.steps == 9 and resumed.to_dict() == {**config.to_dict(), "steps": 9, "learning_rate_schedule_steps": 9}
  # ...a different model does not.
  with pytest.raises(AssertionError, match="searched again"):
    launch.config([*argv, "base_emb_dim=64"], plans=True)


def test_auto_contradicting_custom_actions_is_one_line_exit_2(tmp_path):
  result = run_cli("train_compile", *HEAD_HEAVY, "remat_policy=auto", "query_proj=device",
                   f"base_output_directory={tmp_path}")
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip() == ("config error: remat_policy=auto: query_proj only apply to remat_policy=custom, "
                                   "which auto never picks; drop them or name the policy")
  assert not list(tmp_path.iterdir())


def test_auto_trains_exactly_as_the_setting_it_chose_given_explicitly(tmp_path, caplog):
  # One batch size, and not TINY's 4: a choice not applied would train at 4 and differ.
  common = (*SEARCH, "plan_num_vocab_tiling=[1]", "plan_per_device_batch_sizes=[2]", "steps=3",
            f"base_output_directory={tmp_path}")
  caplog.set_level("INFO")
  auto_argv = _argv(*common, "num_vocab_tiling=auto", "remat_policy=auto", "per_device_batch_size=auto",
                    "run_name=auto", f"metrics_file={tmp_path}/auto.jsonl")
  train.train(launch.config(auto_argv, plans=True))
  assert len([r for r in caplog.records if r.getMessage().startswith("auto: ")]) == 1
  settings = json.loads((tmp_path / "auto" / auto.CACHE_FILE).read_text())["settings"]
  assert set(settings) == set(auto.AUTO_KEYS)
  train.train(pyconfig.initialize(_argv(*common, *plan._assignments(settings), "run_name=explicit",
                                        f"metrics_file={tmp_path}/explicit.jsonl")))
  assert metrics_losses(tmp_path / "auto.jsonl") == metrics_losses(tmp_path / "explicit.jsonl")


def test_a_mixture_of_experts_is_planned_by_its_active_flops():
  """(That a run with a planned key trains as its choice given explicitly is the dense model's test.)"""
  moe = ("decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
         "router_z_loss_weight=0.001")
  search = ("plan_remat_policies=[none,full]", "plan_remat_layer_intervals=[1]", "plan_per_device_batch_sizes=[2]",
            "plan_num_vocab_tiling=[1]")
  config = pyconfig.initialize(_argv(*moe, *search))
  rates = plan.roofline_rates(sharding.run_devices("", 1)[0])
  records = plan.search(config, plan.search_space(config, {"remat_policy"}), 2**40, rates, workers=1)
  # Model FLOPs count the routed experts only, and the step's traced FLOPs count the grouped
  # matmuls: without recomputation the two agree up to attention's masked half, never below 1.
  by_policy = {r["settings"]["remat_policy"]: r["recompute_ratio"] for r in records}
  assert by_policy["full"] > by_policy["none"] >= 1.0


def test_deepseeks_layout_is_planned_by_the_flops_it_executes():
  """DeepSeek-V3's layers in a tiny model, searched like any other: multi-head latent attention, a
  dense first layer, then routed experts (sigmoid scores, correction bias, groups) beside a shared
  expert. The model FLOPs count each kind as it runs: without recomputation the step's traced
  FLOPs exceed them by attention's masked half alone, never fall below; full remat adds more."""
  deepseek = ("decoder_block=deepseek", "attention_type=mla", "base_num_kv_heads=4", "q_lora_rank=12",
              "kv_lora_rank=16", "qk_nope_head_dim=6", "qk_rope_head_dim=4", "v_head_dim=5", "num_experts=8",
              "num_experts_per_tok=2", "base_moe_mlp_dim=16", "routed_score_func=sigmoid", "routed_bias=true",
              "n_routing_groups=4", "topk_routing_group=2", "shared_experts=1", "first_num_dense_layers=1",
              "base_num_decoder_layers=3")
  search = ("plan_remat_policies=[none,full]", "plan_remat_layer_intervals=[1]", "plan_per_device_batch_sizes=[2]",
            "plan_num_vocab_tiling=[1]")
  config = pyconfig.initialize(_argv(*deepseek, *search))
  records = plan.search(config, plan.search_space(config, {"remat_policy"}), 2**40,
                        plan.roofline_rates(sharding.run_devices("", 1)[0]), workers=1)
  by_policy = {r["settings"]["remat_policy"]: r["recompute_ratio"] for r in records}
  assert by_policy["full"] > by_policy["none"] >= 1.0


@pytest.mark.slow
def test_the_context_degree_and_strategy_are_searched():
  """On a v5p-8 (4 chips) at 1024 tokens: every context degree x strategy is compiled (one
  strategy at context 1), and the candidates name them. Degrees 1 and 4: a degree of 2 would
  take the same path at two more TPU compiles."""
  argv = [BASE_YML, *TINY, "compile_topology=v5p-8", "max_target_length=1024", "per_device_batch_size=1",
          "ici_fsdp_parallelism=-1", "plan_remat_policies=[full]", "plan_remat_layer_intervals=[1]",
          "plan_per_device_batch_sizes=[1]", "plan_num_vocab_tiling=[1]", "plan_context_parallelism=[1,4]",
          "plan_context_parallel_strategies=[all_gather,ring]"]
  config = pyconfig.initialize(argv)
  device = sharding.run_devices(config.compile_topology, 1)[0]
  space = plan.search_space(config, {"ici_context_parallelism", "context_parallel_strategy"})
  records = plan.search(config, space, 2**40, plan.roofline_rates(device), workers=1)
  total = {(r["settings"]["ici_context_parallelism"], r["settings"]["context_parallel_strategy"]): r["total_bytes"]
           for r in records}
  assert set(total) == {(1, "all_gather"), (4, "all_gather"), (4, "ring")}
  assert total[(4, "ring")] < total[(4, "all_gather")]  # the ring never holds the whole sequence's keys
  assert "ici_context_parallelism=" in plan.describe(plan.choose(records, 2**40, "test")["settings"])


def test_a_one_value_context_list_is_a_fixed_choice_and_one_that_cannot_divide_the_devices_is_one_line():
  argv = [BASE_YML, *TINY, "compile_topology=v5p-8", "max_target_length=1024", "per_device_batch_size=1",
          "ici_fsdp_parallelism=-1", "plan_remat_policies=[full]", "plan_remat_layer_intervals=[1]",
          "plan_per_device_batch_sizes=[1]", "plan_num_vocab_tiling=[1]"]
  config = pyconfig.initialize([*argv, "plan_context_parallelism=[2]", "plan_context_parallel_strategies=[ring]"])
  space = plan.search_space(config, {"ici_context_parallelism", "context_parallel_strategy"})
  device = sharding.run_devices(config.compile_topology, 1)[0]
  records = plan.search(config, space, 2**40, plan.roofline_rates(device), workers=1)
  assert [(r["settings"]["ici_context_parallelism"], r["settings"]["context_parallel_strategy"]) for r in records] \
      == [(2, "ring")]
  assert "ici_context_parallelism=2 context_parallel_strategy=ring" in plan.describe(records[0]["settings"])
  config = pyconfig.initialize([*argv, "plan_context_parallelism=[3]"])
  with pytest.raises(errors.ConfigError, match=re.escape("plan_context_parallelism=[3]: 3 does not divide the 4 "
                                                         "devices")):
    plan.search_space(config, {"ici_context_parallelism"})


@pytest.mark.parametrize("override, message", [
    ("plan_num_vocab_tiling=[4,1]", "plan_num_vocab_tiling=[4, 1]: must be a non-empty ascending list"),
    ("plan_per_device_batch_sizes=[]", "non-empty ascending list"),
    ("plan_remat_policies=[custom]", "must be a list of names from none, minimal"),
    ("hbm_budget_gib=-1", "hbm_budget_gib=-1.0: must be null or > 0"),
    ("plan_context_parallelism=[4,2]", "plan_context_parallelism=[4, 2]: must be an ascending list"),
    ("plan_context_parallel_strategies=[ulysses]", "must be a list of names from all_gather, ring"),
    # Each would end the search with no candidate compiled, or compile one candidate twice.
    ("plan_num_pipeline_microbatches=[0]", "plan_num_pipeline_microbatches=[0]: must be distinct counts"),
    ("plan_num_pipeline_microbatches=[2,2]", "plan_num_pipeline_microbatches=[2, 2]: must be distinct counts"),
])
def test_bad_plan_keys_are_config_errors(override, message):
  with pytest.raises(errors.ConfigError, match=re.escape(message)):
    pyconfig.initialize(_argv(override))


def test_matmul_bytes_count_operands_and_result_at_loop_trip_counts():
  def layers(x, w):
    return jax.lax.scan(lambda h, _: (h @ w, None), x, None, length=3)[0]

  jaxpr = jax.make_jaxpr(layers)(jnp.ones((8, 16), jnp.float32), jnp.ones((16, 16), jnp.float32)).jaxpr
  assert costs.matmul_bytes(jaxpr) == 3 * 4 * (8 * 16 + 16 * 16 + 8 * 16)


@pytest.mark.slow
def test_the_longest_sequence_that_fits_is_searched_with_mlp_and_attention_chunks():
  """max_target_length=auto: lengths up the ladder until nothing fits; the budget is what 32
  tokens need with full remat, so 32 is the answer and 64 the last length compiled."""
  device = sharding.run_devices("", 1)[0]
  rates = plan.roofline_rates(device)
  fixed = {"remat_policy": "full", "per_device_batch_size": 2, "num_vocab_tiling": 1}
  budget = plan.evaluate(pyconfig.initialize(_argv()), {**fixed, "max_target_length": 32}, rates)["total_bytes"]
  argv = _argv("plan_remat_policies=[full]", "plan_remat_layer_intervals=[1]", "plan_per_device_batch_sizes=[2]",
               "plan_num_vocab_tiling=[1]", "plan_mlp_chunks=[1,2]", "plan_attention_head_chunks=[1,2]")
  config = pyconfig.initialize(argv)
  records = plan.search_longest(config, plan.search_space(config, set(plan.SEARCH_KEYS)), budget, rates, 1,
                                [32, 64, 128])
  assert {r["settings"]["max_target_length"] for r in records} == {32}
  assert {r["settings"]["mlp_chunks"] for r in records} == {1, 2}
  assert {r["settings"]["attention_head_chunks"] for r in records} == {1, 2}
  assert plan.choose(records, budget, "test")["settings"]["max_target_length"] == 32


def test_policies_that_keep_the_same_tensors_on_cpu_compile_once_and_to_the_same_step():
  """On CPU host memory is device memory: an offloaded policy keeps what its on-device twin
  keeps, so the search compiles one of them, and compiled, the two steps are the same size and
  speed."""
  config = pyconfig.initialize(_argv("plan_remat_policies=[save_qkv_proj,qkv_proj_offloaded,full,input_offloaded]"))
  assert plan.search_space(config, {"remat_policy"})["remat_policy"] == ["save_qkv_proj", "full"]
  rates = plan.roofline_rates(sharding.run_devices("", 1)[0])
  fixed = {"per_device_batch_size": 2, "num_vocab_tiling": 1}
  total = {}
  for kept, twin in (("save_qkv_proj", "qkv_proj_offloaded"), ("full", "input_offloaded")):
    a, b = (plan.evaluate(pyconfig.initialize(_argv()), {**fixed, "remat_policy": p}, rates) for p in (kept, twin))
    assert (a["total_bytes"], a["step_flops_per_step"]) == (b["total_bytes"], b["step_flops_per_step"])
    total[kept] = a["total_bytes"]
  # The search takes a policy that keeps more to need no less memory: what does not fit for full
  # does not fit for save_qkv_proj.
  assert remat.needs_no_less("save_qkv_proj", "full", "cpu") and not remat.needs_no_less("full", "save_qkv_proj", "cpu")
  assert total["save_qkv_proj"] >= total["full"]
  tpu = pyconfig.initialize(_argv("compile_topology=v5p-8", "plan_remat_policies=[full,input_offloaded]"))
  assert plan.search_space(tpu, {"remat_policy"})["remat_policy"] == ["full", "input_offloaded"]


@pytest.mark.slow
def test_the_pruned_search_chooses_at_least_as_fast_as_the_ladders_over_the_whole_grid():
  """Intervals, batches and tiles, with the budget where full remat fits batch 2 at 4 tiles only.
  From the whole grid compiled, the ladders keep at each interval and batch the fewest tiles
  that fit, up to the first batch where none does; the pruned search (fewer compiles, some
  skipped for their speed bound) chooses a candidate that fits and is at least as fast as each
  of those, and no interval tries a batch that did not fit at its most tiles at the interval
  below."""
  search = ("plan_remat_policies=[full]", "plan_remat_layer_intervals=[1,2]",
            "plan_per_device_batch_sizes=[2,4]", "plan_num_vocab_tiling=[1,2,4]", "base_num_decoder_layers=2")
  config = pyconfig.initialize(_argv(*search))
  rates = plan.roofline_rates(sharding.run_devices("", 1)[0])
  budget = plan.evaluate(config, {"remat_policy": "full", "per_device_batch_size": 2, "num_vocab_tiling": 4},
                         rates)["total_bytes"]
  space = plan.search_space(config, set(plan.SEARCH_KEYS) - {"mlp_chunks", "attention_head_chunks",
                                                             "gradient_accumulation_steps"})
  pruned = plan.search(config, space, budget, rates, workers=1)
  # What the pruned search compiled compiles to the same step again: its record stands for it.
  keys = ("remat_policy", "remat_layer_interval", "per_device_batch_size", "num_vocab_tiling")
  compiled = {tuple(r["settings"][k] for k in keys): r for r in pruned if r["status"] == "ok"}
  every, kept = 0, []
  for policy in space["remat_policy"]:
    for interval in space["remat_layer_interval"]:
      for batch in space["per_device_batch_size"]:
        fitting = []
        for tiles in space["num_vocab_tiling"]:
          settings = {"remat_policy": policy, "remat_layer_interval": interval, "per_device_batch_size": batch,
                      "num_vocab_tiling": tiles}
          record = compiled.get(tuple(settings[k] for k in keys)) or plan.evaluate(config, settings, rates)
          every += 1
          if record["status"] == "ok" and record["total_bytes"] <= budget:
            fitting.append({**record, "fits": True})
        if not fitting:
          break
        kept.append(fitting[0])
  assert len(pruned) < every
  chosen = plan.choose(pruned, budget, "test")
  assert chosen["total_bytes"] <= budget
  assert chosen["tokens_per_second_per_chip"] >= plan.choose(kept, budget, "test")["tokens_per_second_per_chip"]
  most = space["num_vocab_tiling"][-1]
  over_at_1 = {r["settings"]["per_device_batch_size"] for r in pruned if r["settings"]["remat_layer_interval"] == 1
               and r["settings"]["num_vocab_tiling"] == most and not r["fits"]}
  tried_at_2 = {r["settings"]["per_device_batch_size"] for r in pruned if r["settings"]["remat_layer_interval"] == 2}
  assert not tried_at_2 & over_at_1


def test_the_speed_bound_with_the_compiled_bytes_is_the_roofline():
  """evaluate() skips a compile whose FLOPs and bytes bound its speed below the floor; given
  XLA's bytes as they compile, the bound is the roofline itself: a floor just above the
  compiled speed skips the compile, one just below keeps it."""
  config = pyconfig.initialize(_argv())
  rates = plan.roofline_rates(sharding.run_devices("", 1)[0])
  settings = {"remat_policy": "full", "per_device_batch_size": 2, "num_vocab_tiling": 1}
  compiled = plan.evaluate(config, settings, rates)
  speed, xla_bytes = compiled["tokens_per_second_per_chip"], compiled["cost_analysis_bytes_per_device"]
  assert plan.evaluate(config, settings, rates, speed * 1.001, xla_bytes)["status"] == "pruned"
  again = plan.evaluate(config, settings, rates, speed * 0.999, xla_bytes)
  assert again["status"] == "ok" and again["tokens_per_second_per_chip"] == pytest.approx(speed)


def test_the_pipeline_degree_microbatches_and_schedule_are_searched():
  """On the 8 simulated devices: the chains are no pipeline, and 2 stages with 2 or 8 microbatches
  under each schedule, 1F1B with and without its residuals kept (the microbatches and schedule
  only where there are stages, kept residuals only under 1F1B), each named in its candidates;
  compiled, 1F1B with 8 microbatches holds fewer of them than GPipe."""
  argv = [BASE_YML, *TINY, "base_num_decoder_layers=4", "per_device_batch_size=4", "ici_fsdp_parallelism=-1",
          "plan_remat_policies=[full]", "plan_remat_layer_intervals=[1]", "plan_per_device_batch_sizes=[4]",
          "plan_num_vocab_tiling=[1]", "plan_pipeline_parallelism=[1,2]", "plan_num_pipeline_microbatches=[2,8]",
          "plan_pipeline_schedules=[gpipe,1f1b]", "plan_pipeline_keep_residuals=[false,true]"]
  with on_devices(8):
    config = pyconfig.initialize(argv)
    space = plan.search_space(config, set(plan.PIPELINE_KEYS))
    chains = [tuple(s[k] for k in plan.PIPELINE_KEYS) for s in plan._settings(space)]
    assert chains == [(1, 1, 2, "gpipe", False)] + [(2, 1, count, *schedule) for count in (2, 8) for schedule in
                                                    (("gpipe", False), ("1f1b", False), ("1f1b", True))]
    rates = plan.roofline_rates(sharding.run_devices("", 1)[0])
    temp = {schedule: plan.evaluate(config, {"ici_pipeline_parallelism": 2, "num_pipeline_microbatches": 8,
                                             "pipeline_schedule": schedule}, rates)["temp_bytes"]
            for schedule in ("gpipe", "1f1b")}
  assert temp["1f1b"] < temp["gpipe"]
  assert ("ici_pipeline_parallelism=2 dcn_pipeline_parallelism=1 num_pipeline_microbatches=8 pipeline_schedule=1f1b "
          "pipeline_keep_residuals=True" in plan.describe(dict(zip(plan.PIPELINE_KEYS, chains[-1]))))


def test_stages_across_slices_are_searched():
  """Two v5p-8 slices (libtpu's compiler): the chains are data parallelism over the slices and two
  stages across them (1F1B, no schedule named), the second compiled with its stages on the slices;
  a list the slices cannot take, or nothing to take the slices the stages leave, is one line."""
  slices = ("compile_topology=v5p-8", "compile_topology_num_slices=2", "base_num_decoder_layers=4",
            "plan_remat_policies=[full]", "plan_remat_layer_intervals=[1]", "plan_per_device_batch_sizes=[4]",
            "plan_num_vocab_tiling=[1]")
  config = pyconfig.initialize([BASE_YML, *TINY, *slices, "dcn_data_parallelism=-1",
                                "plan_dcn_pipeline_parallelism=[1,2]"])
  chains = plan._settings(plan.search_space(config, set(plan.PIPELINE_KEYS)))
  assert [tuple(s[k] for k in plan.PIPELINE_KEYS) for s in chains] == [(1, 1, -1, None, False), (1, 2, -1, None, False)]
  staged = pyconfig.replace(config, {k: chains[1][k] for k in plan.PIPELINE_KEYS})
  assert staged.dcn_mesh_shape[sharding.MESH_AXES.index("pipeline")] == 2 and staged.pipeline_schedule == "1f1b"
  record = plan.evaluate(config, {**chains[1], "remat_layer_interval": 1, "per_device_batch_size": 4,
                                  "num_vocab_tiling": 1}, plan.roofline_rates(sharding.run_devices("v5p-8", 2)[0]))
  assert record["status"] == "ok" and record["total_bytes"] > 0, record
  for overrides, message in [(("dcn_data_parallelism=-1", "plan_dcn_pipeline_parallelism=[1,4]"),
                              r"plan_dcn_pipeline_parallelism=\[1, 4\]: 4 does not divide the 2 slices"),
                             (("dcn_data_parallelism=2", "plan_dcn_pipeline_parallelism=[1,2]"),
                              r"needs another dcn_\*_parallelism=-1")]:
    with pytest.raises(errors.ConfigError, match=message):
      plan.search_space(pyconfig.initialize([BASE_YML, *TINY, *slices, *overrides]), set(plan.PIPELINE_KEYS))
