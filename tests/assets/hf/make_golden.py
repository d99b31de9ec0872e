"""Writes the Hugging Face parity assets: python tests/assets/hf/make_golden.py [NAME ...] (all,
or only the named ones; needs torch and transformers, which are not runtime dependencies; any
versions that have Qwen3, Gemma 2, Gemma 3, Qwen3-MoE, Qwen3-Next, Mixtral, DeepSeek-V2 and V3, Llama 4 and GPT-OSS; Gemma 3's RoPE per layer type
needs transformers 5).

For each family, a small randomly initialised transformers model saved as Hugging Face does
(config.json, model.safetensors), its float32 logits on fixed tokens and its greedy
continuation of a prompt (golden.npz), which tests/test_hf_checkpoint.py compares with this
project's model on the converted weights.
"""

import json
import os
import sys

import numpy as np
import torch
import transformers

def gemma3_multimodal(torch_dtype, attn_implementation, **text):
  """Gemma3ForConditionalGeneration's config: the text model given, a one-layer vision tower."""
  vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
  return transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text), vision_config=vision,
                                   mm_tokens_per_image=4, boi_token_index=93, eoi_token_index=94, image_token_index=95,
                                   torch_dtype=torch_dtype, attn_implementation=attn_implementation)


SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)
PROMPT, GREEDY = 8, 8  # greedy decoding: the first row's first PROMPT tokens, continued by GREEDY tokens
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(tie_word_embeddings=True)),
    # Llama 3.1/3.2's RoPE rescaling, with an original context short enough that the 24 test
    # tokens span slowed, blended and kept frequencies; tied like Llama 3.2.
    "llama3.1": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        tie_word_embeddings=True, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=16))),
    # Gemma 2 with every feature made to bite at this size: a window of 8 of the 24 tokens,
    # query scale and both soft caps small enough that the caps are far from linear.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, initializer_range=0.2)),
    # Gemma 3 with every feature made to bite: 7 layers, so local layers both before and after
    # the global layer 5; a window of 4; the local and global RoPE bases far apart, the global
    # positions slowed 8 times; query scale off head_dim.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=7, tie_word_embeddings=True, sliding_window=4, query_pre_attn_scalar=24,
        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
        initializer_range=0.2)),
    # The same text model inside Gemma3ForConditionalGeneration, as Gemma 3 4B, 12B and 27B are
    # published; the golden logits are its logits of text alone.
    "gemma3_multimodal": (gemma3_multimodal, transformers.Gemma3ForConditionalGeneration, dict(
        num_hidden_layers=7, tie_word_embeddings=True, sliding_window=4, query_pre_attn_scalar=24,
        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
        initializer_range=0.2)),
    # Mixtures of 4 experts, 2 per token, tied and untied, Qwen3-MoE's top-k weights renormalised
    # or not (Mixtral's always are).
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True)),
    "qwen3_moe_tied": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=False)),
    # OLMo 3 with every feature made to bite: 5 layers, so sliding layers both before and after the
    # global layer 3; a window of 4; YaRN over a short original context on the global layer only
    # (its sliding layers' RoPE plain, at the same base); random q/k norms over the whole projections.
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, dict(
        num_hidden_layers=5, tie_word_embeddings=False, sliding_window=4, initializer_range=0.2,
        rope_parameters=dict(full_attention=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                 original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0)))),
    # Every other layer routed (decoder_sparse_step 2), the others dense MLPs: a block of two layer kinds.
    "qwen3_moe_interleaved": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=4, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2)),
    # DeepSeek-V3 with every feature made to bite: latent attention with low-rank queries, values
    # narrower than queries and keys, 8 RoPE features (whose interleaved order is not its own
    # inverse), YaRN over a short original context; a dense first layer, then
    # 8 experts in 4 groups of which each token's 2 come from the best 2, a shared expert, the
    # weights renormalised and scaled, and a correction bias that changes the choice.
    "deepseek3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_hidden_layers=4, num_key_value_heads=4, head_dim=8, first_k_dense_replace=1, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
        # Its default end-of-sequence token is 1, which generate's min_new_tokens would suppress.
        eos_token_id=95, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    # DeepSeek-V2 with every feature made to bite: latent attention with queries projected directly
    # (no q-LoRA), 8 interleaved RoPE features, YaRN over a short original context with mscale and
    # mscale_all_dim apart (so both the RoPE's and the scores' factors differ from 1); a dense first
    # layer, then 8 experts of which each token's 2 by softmax score, weights not renormalised and
    # scaled, and 2 shared experts.
    "deepseek2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(
        num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, moe_intermediate_size=24, topk_method="greedy", routed_scaling_factor=2.5,
        norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=6, eos_token_id=95, tie_word_embeddings=False, initializer_range=0.2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707))),
    # Llama 4 with every piece biting: 4 layers, routed and dense alternating (Maverick's
    # interleave_moe_layer_step 2) with the NoPE layer 3 routed; chunks of 8 of the 24 tokens on the
    # RoPE layers; temperature tuning stepping every 4 positions; Scout's unit-RMS queries and keys;
    # Llama 3.1's RoPE rescaling with equal frequency factors (Scout's), over a short original context;
    # top-1 of 4 experts by a decisive router, and the shared expert.
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, dict(
        num_hidden_layers=4, tie_word_embeddings=False, intermediate_size=24, intermediate_size_mlp=64,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=4,
        attention_chunk_size=8, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
        initializer_range=0.2, eos_token_id=95,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=16.0, low_freq_factor=1.0,
                             high_freq_factor=1.0, original_max_position_embeddings=16))),
    # GPT-OSS with every piece biting: 4 layers, sliding (a window of 4) and full alternating;
    # random sinks and q/k/v/o biases; YaRN with its blend's bounds not rounded (its upper bound,
    # 2.0 pairs at this width and original context, would round to 3); top-2 of 4 experts with random router and expert biases; a clamp (1.5) that the
    # gate and up projections reach.
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        num_hidden_layers=4, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        swiglu_limit=1.5, initializer_range=0.2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=32.0, beta_slow=1.0, truncate=False))),
    # The same GPT-OSS with its experts in MXFP4, as the published checkpoints keep them (see
    # mxfp4_experts).
    "gpt_oss_mxfp4": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        num_hidden_layers=4, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        swiglu_limit=1.5, initializer_range=0.2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=32.0, beta_slow=1.0, truncate=False))),
    # Qwen3-Next with every piece biting: three Gated DeltaNet layers to one gated attention layer,
    # two value heads per key head, a quarter of each attention head rotated; 4 experts, 2 per
    # token, and the gated shared expert. Its decays are drawn slow (A_log below), so the state
    # carries across the chunks.
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, dict(
        num_hidden_layers=4, tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24, norm_topk_prob=True,
        eos_token_id=95, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral_tied": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        tie_word_embeddings=True, num_local_experts=4, num_experts_per_tok=2)),
}


def mxfp4_experts(model, directory):
  """Random MXFP4 experts: each layer's gate_up_proj and down_proj made of random 4-bit values and
  block scales (2^-5 to 2^-3), loaded into the model as transformers' own dequantization gives
  them, and saved as the published checkpoints keep them (NAME_blocks, NAME_scales bytes, the
  quantization_config), in place of the model's float tensors."""
  from safetensors.torch import load_file, save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  rng = np.random.default_rng(1)
  packed = {}
  for name, param in model.named_parameters():
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      experts, inputs, outputs = param.shape
      blocks = torch.as_tensor(rng.integers(0, 256, (experts, outputs, inputs // 32, 16)), dtype=torch.uint8)
      scales = torch.as_tensor(rng.integers(122, 125, (experts, outputs, inputs // 32)), dtype=torch.uint8)
      with torch.no_grad():
        param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
      packed |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
  model.save_pretrained(directory, safe_serialization=True)
  tensors = {n: t for n, t in load_file(os.path.join(directory, "model.safetensors")).items()
             if f"{n}_blocks" not in packed}
  save_file({**tensors, **packed}, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  config = os.path.join(directory, "config.json")
  with open(config) as f:
    settings = json.load(f)
  settings["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
  with open(config, "w") as f:
    json.dump(settings, f, indent=2)


# Written their own way after the random initialisation: name -> (model, directory) -> None.
SAVED_BY = {"gpt_oss_mxfp4": mxfp4_experts}


def main():
  here = os.path.dirname(os.path.abspath(__file__))
  tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (2, 24))
  for name, (config_class, model_class, extra) in MODELS.items():
    if sys.argv[1:] and name not in sys.argv[1:]:
      continue
    torch.manual_seed(0)
    # eager: the attention that applies Gemma 2's soft cap (SDPA has none)
    model = model_class(config_class(**{**SHAPE, **extra}, torch_dtype="float32", attn_implementation="eager")).eval()
    with torch.no_grad():  # random norms too, so a norm mapped to the wrong place shows
      for param_name, param in model.named_parameters():
        if param_name.endswith("norm.weight"):
          param.uniform_(0.5, 1.5)
        elif param_name.endswith(("mlp.gate.weight", "router.weight")):  # a decisive router: no near-ties in the top k
          param.normal_(0, 1.0)
        elif param_name.endswith(("_bias", ".bias", "sinks")):  # GPT-OSS's biases and sinks, zero at first
          param.normal_(0, 0.5)
        elif param_name.endswith("A_log"):  # Gated DeltaNet: decays of exp(-0.05) to exp(-1) a token
          param.uniform_(-3.0, 0.0)
      for buffer_name, buffer in model.named_buffers():
        # Positive, as transformers zeroes the masked groups' scores rather than excluding them.
        if buffer_name.endswith("e_score_correction_bias"):
          buffer.uniform_(0.0, 0.5)
    SAVED_BY.get(name, lambda model, directory: model.save_pretrained(directory, safe_serialization=True))(
        model, os.path.join(here, name))
    with torch.no_grad():
      logits = model(torch.as_tensor(tokens)).logits.numpy()
      prompt = torch.as_tensor(tokens[:1, :PROMPT])
      greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=GREEDY, min_new_tokens=GREEDY, pad_token_id=0).numpy()[0, PROMPT:]
    np.savez(os.path.join(here, name, "golden.npz"), tokens=tokens.astype(np.int32), logits=logits,
             greedy_prompt=tokens[0, :PROMPT].astype(np.int32), greedy=greedy.astype(np.int32))
    print(name, logits.shape)


if __name__ == "__main__":
  main()
