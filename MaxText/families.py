"""Decoder families: one `Family` record each, the only place a family is named.

`decoder_block=NAME` picks `FAMILIES[NAME]`. The layers read only its switches (copied into the
config as keys of the same names), and the Hugging Face converters read the rest: how
transformers names the architecture, its activation and its experts, and what it assumes where
a config.json is silent. docs/guides/port_a_model.md says how to add one.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
  """A decoder family. The fields before the hf_ ones are the layers' switches (SWITCHES)."""

  # RMSNorm over each head's queries and keys before RoPE (Qwen3).
  qk_norm: bool = False
  # Norms both before and after attention and the MLP (Gemma 2).
  sandwich_norms: bool = False
  # Norms after attention and the MLP only, none before (OLMo 2/3).
  post_norms: bool = False
  # With qk_norm, one RMSNorm over all heads' queries (keys) together, not one per head (OLMo 2/3).
  qk_norm_over_heads: bool = False
  # RMSNorm scales by 1 + w, w stored zero-centred (Gemma).
  norm_plus_one: bool = False
  # Embeddings times sqrt(base_emb_dim) (Gemma).
  scale_embedding: bool = False
  # The MLP gate's nonlinearity, a key of layers/linears.ACTIVATIONS: silu (SwiGLU) or gelu_tanh (GeGLU).
  mlp_activation: str = "silu"
  # Every layer's MLP is a mixture of num_experts experts (layers/moe.py).
  moe: bool = False
  # The router's weight scales its one expert's input, not the expert's output (Llama 4; top-1).
  routed_input_scaling: bool = False
  # With sliding_window_size, the last layer of every this many attends to the whole row and the
  # others to the window (Gemma 2: 2, layers 0, 2, 4, ... sliding; Gemma 3: 6, five local then one global).
  sliding_window_pattern: int = 2
  # All but the last of every inhomogeneous_layer_cycle_interval layers are Gated DeltaNet layers
  # (layers/gated_delta_net.py), the others attention (Qwen3-Next).
  gated_delta_net: bool = False
  # The attention's output is gated per head and feature by sigmoid of a second query projection
  # (Qwen3-Next: the query kernel holds each head's queries, then its gates).
  attention_output_gate: bool = False
  # The shared experts' output is scaled per token by sigmoid(x . w), w [D] (Qwen3-Next).
  shared_expert_gate: bool = False

  # Hugging Face: config.json's `architectures[0]` and `model_type`.
  hf_architecture: str = ""
  hf_model_type: str = ""
  # config.json's activation key and value for mlp_activation.
  hf_activation_key: str = "hidden_act"
  hf_activation: str = "silu"
  # What transformers assumes where config.json is silent: a tied head (tie_word_embeddings),
  # and the family's sliding_window_pattern when `sliding_window` is set without `layer_types`.
  hf_tied_by_default: bool = False
  hf_sliding_by_default: bool = False
  # transformers keys rope_parameters by layer type (full_attention, sliding_attention), and its
  # version 4 names the local base rope_local_base_freq: the sliding layers have their own base (Gemma 3).
  hf_rope_by_layer_type: bool = False
  # The sliding layers' base where config.json names none (version 4's files, keyed by neither):
  # 0 for the global layers' own (OLMo 3, whose rope_scaling rescales the global layers only).
  hf_local_rope_base: float = 0.0
  # A mixture of experts' tensor names under model.layers.{i}: (router, expert e's gate, up and
  # down projections); config.json's key for the expert count and for one expert's width.
  hf_expert_names: tuple[str, str, str, str] | None = None
  hf_num_experts_key: str = "num_experts"
  # config.json's key for interleave_moe_layer_step (every N-th layer routed, the others dense); "":
  # the class routes every layer.
  hf_moe_step_key: str = ""
  hf_expert_width_key: str = "moe_intermediate_size"
  # config.json's key for the dense MLPs' width (base_mlp_dim) and their tensors' prefix under
  # model.layers.{i}.
  hf_dense_width_key: str = "intermediate_size"
  hf_mlp_prefix: str = "mlp."
  # A layer's experts in one tensor each, named by hf_expert_names without {e}: [E, D, 2F] of the
  # gate and up projections, "halves" (the gate's features, then the up projection's: Llama 4) or
  # "interleaved" (feature j of the gate at 2j, of the up projection at 2j + 1: GPT-OSS), and
  # [E, F, D]; "": a tensor per expert.
  hf_fused_experts: str = ""
  # With mlp_bias, under model.layers.{i}: the router's bias, the experts' gate and up projections'
  # biases [E, 2F] (laid out as their kernels) and the down projection's [E, D] (GPT-OSS).
  hf_expert_biases: tuple = ()
  # config.json's key for mlp_activations_limit (GPT-OSS: swiglu_limit); "": the class has none.
  hf_activation_limit_key: str = ""
  # The class has attention sinks (self_attn.sinks) and, where config.json's attention_bias says,
  # the q, k, v and o projections' biases (GPT-OSS).
  hf_sinks: bool = False
  hf_attention_bias: bool = False
  # q_proj's and k_proj's features in interleaved RoPE pairs (2j, 2j + 1) in each head: Meta's
  # layout, which Llama 4's class keeps (the others' half-split, this project's too).
  hf_rope_interleaved: bool = False
  # The class has Llama 4's attention: chunks on the RoPE layers, NoPE layers with temperature
  # tuning, unit-RMS queries and keys (config.json's attention_chunk_size, no_rope_layers,
  # attn_temperature_tuning, attn_scale, floor_scale, use_qk_norm).
  hf_llama4_attention: bool = False
  # True or False where the Hugging Face class always or never renormalises the top-k router
  # weights, whatever config.json says (Mixtral has no norm_topk_prob key, DeepSeek-V2 ignores
  # its); None where config.json says.
  hf_norm_topk_prob: bool | None = None
  # A multimodal class whose language model is this family's (imported alone): its architecture,
  # and what transformers assumes where its config.json's text_config is silent (the Hub's files
  # name only what differs from those defaults), as (key, value) pairs.
  hf_multimodal_architecture: str = ""
  hf_text_config_defaults: tuple = ()
  # DeepSeek's class: its attention (an attentions.ATTENTION_TYPES name), its routing where
  # config.json does not say it, as (config key, value) pairs, and, under model.layers.{i}, the
  # router's correction bias and the shared experts' MLP. Its checkpoints hold the multi-token
  # prediction block as the layers after the last, which transformers does not run.
  hf_attention_type: str = "global"
  hf_routing: tuple = ()
  hf_router_bias: str = ""
  hf_shared_experts: str = ""
  hf_layers_after_last: bool = False
  # config.json's key for the shared experts' width, shared_experts times base_moe_mlp_dim
  # (Qwen3-Next's shared_expert_intermediate_size); "": they are counted (n_shared_experts).
  hf_shared_expert_width_key: str = ""
  # The class rotates the first partial_rotary_factor of each head's features (rope_parameters'
  # partial_rotary_factor; Qwen3-Next); the others rotate all of them.
  hf_partial_rotary: bool = False
  # DeepSeek-V2's config.json chooses its class's routing by topk_method: the one value converted,
  # which routes without groups (its other, group_limited_greedy, ranks a group by its best
  # expert, where this project ranks it by its best two, as DeepSeek-V3); "": not read.
  hf_topk_method: str = ""

  SWITCHES = ("qk_norm", "sandwich_norms", "post_norms", "qk_norm_over_heads", "norm_plus_one", "scale_embedding",
              "mlp_activation", "moe", "routed_input_scaling", "sliding_window_pattern", "gated_delta_net",
              "attention_output_gate", "shared_expert_gate")

  def switches(self) -> dict:
    """The layers' switches, as config keys."""
    return {name: getattr(self, name) for name in self.SWITCHES}


_LLAMA = Family(hf_architecture="LlamaForCausalLM", hf_model_type="llama")
_QWEN3 = dataclasses.replace(_LLAMA, qk_norm=True, hf_architecture="Qwen3ForCausalLM", hf_model_type="qwen3")
# DeepSeek-V3: Llama's layer with latent attention (attention_type=mla) and, after
# first_num_dense_layers dense layers, experts chosen by sigmoid scores and a correction bias
# within the best groups, plus shared experts.
_DEEPSEEK = dataclasses.replace(
    _LLAMA, moe=True, hf_architecture="DeepseekV3ForCausalLM", hf_model_type="deepseek_v3",
    hf_expert_names=("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                     "mlp.experts.{e}.down_proj.weight"),
    hf_num_experts_key="n_routed_experts", hf_attention_type="mla",
    hf_routing=(("routed_score_func", "sigmoid"), ("routed_bias", True)),
    hf_router_bias="mlp.gate.e_score_correction_bias", hf_shared_experts="mlp.shared_experts.",
    hf_layers_after_last=True)
_GEMMA2 = Family(
    sandwich_norms=True, norm_plus_one=True, scale_embedding=True, mlp_activation="gelu_tanh",
    hf_architecture="Gemma2ForCausalLM", hf_model_type="gemma2", hf_activation_key="hidden_activation",
    hf_activation="gelu_pytorch_tanh", hf_tied_by_default=True, hf_sliding_by_default=True)

FAMILIES = {
    # Llama 2, 3, 3.1, 3.2.
    "llama2": _LLAMA,
    "qwen3": _QWEN3,
    # Gemma 2's published config.json names neither a tied head nor layer_types.
    "gemma2": _GEMMA2,
    # Gemma 3 (text): Gemma 2's layer with query/key norms (1 + w, as its other norms), five local
    # layers to one global; its soft caps are off and its RoPE bases are model keys.
    "gemma3": dataclasses.replace(
        _GEMMA2, qk_norm=True, sliding_window_pattern=6, hf_architecture="Gemma3ForCausalLM",
        hf_model_type="gemma3_text", hf_rope_by_layer_type=True, hf_local_rope_base=10000.0,
        hf_multimodal_architecture="Gemma3ForConditionalGeneration",
        hf_text_config_defaults=(("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216),
                                 ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4),
                                 ("head_dim", 256), ("rms_norm_eps", 1e-6), ("rope_theta", 1000000.0),
                                 ("rope_local_base_freq", 10000.0), ("query_pre_attn_scalar", 256),
                                 ("sliding_window", 4096), ("sliding_window_pattern", 6))),
    "deepseek": _DEEPSEEK,
    # Llama 4 (text): Llama's layer with Llama 4's attention (chunked RoPE layers, a NoPE layer in
    # every 4 with temperature tuning, Scout's unit-RMS queries and keys) and, on every layer (Scout)
    # or every other (Maverick, interleave_moe_layer_step 2; the others dense MLPs of
    # intermediate_size_mlp), a top-1 mixture whose expert's input is weighted by the sigmoid of its
    # router logit, plus a shared expert.
    "llama4": dataclasses.replace(
        _LLAMA, moe=True, routed_input_scaling=True, hf_architecture="Llama4ForCausalLM",
        hf_model_type="llama4_text",
        hf_expert_names=("feed_forward.router.weight", "feed_forward.experts.gate_up_proj",
                         "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
        hf_num_experts_key="num_local_experts", hf_moe_step_key="interleave_moe_layer_step",
        hf_expert_width_key="intermediate_size", hf_dense_width_key="intermediate_size_mlp",
        hf_mlp_prefix="feed_forward.", hf_fused_experts="halves", hf_rope_interleaved=True, hf_llama4_attention=True,
        hf_norm_topk_prob=False, hf_shared_experts="feed_forward.shared_expert.",
        hf_multimodal_architecture="Llama4ForConditionalGeneration",
        hf_text_config_defaults=(("vocab_size", 202048), ("hidden_size", 5120), ("intermediate_size", 8192),
                                 ("intermediate_size_mlp", 16384), ("num_hidden_layers", 48),
                                 ("num_attention_heads", 40), ("num_key_value_heads", 8), ("head_dim", 128),
                                 ("rms_norm_eps", 1e-5), ("rope_theta", 500000.0), ("num_local_experts", 16),
                                 ("num_experts_per_tok", 1), ("interleave_moe_layer_step", 1)),
        hf_routing=(("routed_score_func", "sigmoid"), ("shared_experts", 1), ("routed_scaling_factor", 1.0),
                    ("first_num_dense_layers", 0), ("n_routing_groups", -1), ("topk_routing_group", -1))),
    # OLMo 3: norms after attention and the MLP only, q/k norms over the whole projections, three
    # sliding layers to one global; YaRN on the global layers, plain RoPE on the sliding ones
    # (local_rope_max_timescale: the same base).
    "olmo3": dataclasses.replace(
        _LLAMA, qk_norm=True, post_norms=True, qk_norm_over_heads=True, sliding_window_pattern=4,
        hf_architecture="Olmo3ForCausalLM", hf_model_type="olmo3", hf_sliding_by_default=True,
        hf_rope_by_layer_type=True),
    # DeepSeek-V2 (V2-Lite; greedy routing): V3's layer, its experts chosen by softmax score with no
    # correction bias and no groups; transformers' class never renormalises the top-k weights
    # (config.json's norm_topk_prob it ignores), and its checkpoints hold no prediction layers.
    "deepseek2": dataclasses.replace(
        _DEEPSEEK, hf_architecture="DeepseekV2ForCausalLM", hf_model_type="deepseek_v2", hf_routing=(),
        hf_router_bias="", hf_layers_after_last=False, hf_norm_topk_prob=False, hf_topk_method="greedy"),
    "qwen3_moe": dataclasses.replace(
        _QWEN3, moe=True, hf_architecture="Qwen3MoeForCausalLM", hf_model_type="qwen3_moe",
        hf_moe_step_key="decoder_sparse_step",
        hf_expert_names=("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                         "mlp.experts.{e}.down_proj.weight")),
    # Qwen3-Next: three Gated DeltaNet layers to one attention layer (inhomogeneous_layer_cycle_interval
    # 4), the attention's output gated and its RoPE partial, zero-centred norms (1 + w); every layer
    # a mixture of experts plus a shared expert whose output a sigmoid gates.
    "qwen3_next": dataclasses.replace(
        _QWEN3, moe=True, norm_plus_one=True, gated_delta_net=True, attention_output_gate=True,
        shared_expert_gate=True, hf_architecture="Qwen3NextForCausalLM", hf_model_type="qwen3_next",
        hf_moe_step_key="decoder_sparse_step",
        hf_expert_names=("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                         "mlp.experts.{e}.down_proj.weight"),
        hf_shared_experts="mlp.shared_expert.", hf_shared_expert_width_key="shared_expert_intermediate_size",
        hf_partial_rotary=True,
        hf_routing=(("routed_scaling_factor", 1.0), ("first_num_dense_layers", 0), ("n_routing_groups", -1),
                    ("topk_routing_group", -1))),
    # Mixtral's experts are w1 (gate), w3 (up) and w2 (down), intermediate_size wide.
    # GPT-OSS: Llama's layer with biased projections and sinks in its attention, every other layer
    # sliding (a window of 128), YaRN without rounding its blend's bounds; every layer a mixture of
    # experts with biases, chosen by softmax over the top-k router logits, whose gated unit is
    # clamped, x sigmoid(1.702 x), times (up + 1).
    "gpt_oss": dataclasses.replace(
        _LLAMA, moe=True, mlp_activation="quick_gelu", hf_architecture="GptOssForCausalLM", hf_model_type="gpt_oss",
        hf_sliding_by_default=True,
        hf_expert_names=("mlp.router.weight", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj",
                         "mlp.experts.down_proj"),
        hf_expert_biases=("mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"),
        hf_fused_experts="interleaved", hf_num_experts_key="num_local_experts",
        hf_expert_width_key="intermediate_size", hf_norm_topk_prob=True, hf_activation_limit_key="swiglu_limit",
        hf_sinks=True, hf_attention_bias=True),
    "mixtral": dataclasses.replace(
        _LLAMA, moe=True, hf_architecture="MixtralForCausalLM", hf_model_type="mixtral",
        hf_expert_names=("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                         "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
        hf_num_experts_key="num_local_experts", hf_expert_width_key="intermediate_size", hf_norm_topk_prob=True),
}
