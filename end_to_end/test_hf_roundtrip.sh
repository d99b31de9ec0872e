#!/usr/bin/env bash
# Bring your own weights, for every family in tests/assets/hf (llama, llama3.1, qwen3, gemma2, gemma3, and the
# mixtures of experts qwen3_moe and mixtral, each with an untied and a tied head):
#   1. import the Hugging Face model (every model key from its config.json);
#   2. parity: the imported model's logits equal transformers' (golden.npz) to 1e-5;
#   3. 5 training steps from it with num_vocab_tiling=8;
#   4. export the trained checkpoint to Hugging Face, import the export again: the same logits
#      as the trained checkpoint; with HF_PYTHON set to a python that has torch and
#      transformers, transformers' logits of the export are compared with them too.
# Usage: bash end_to_end/test_hf_roundtrip.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's MaxText for end_to_end/hf_logits.py too
out=${1:-$(mktemp -d)}
python=${PYTHON:-.venv/bin/python}

for family in llama llama3.1 qwen3 gemma2 gemma3 qwen3_moe qwen3_moe_tied mixtral mixtral_tied; do
  hf=tests/assets/hf/$family
  dir=$out/$family
  echo "== $family: import"
  "$python" -m MaxText.checkpoint_conversion.to_maxtext configs/base.yml "hf_model_path=$hf" \
    "base_output_directory=$dir" run_name=imported
  echo "== $family: parity with transformers"
  "$python" end_to_end/hf_logits.py "$dir/imported/checkpoints/0" "$hf/golden.npz" --reference "$hf/golden.npz"
  echo "== $family: 5 steps with num_vocab_tiling=8"
  "$python" -m MaxText.train configs/base.yml "load_parameters_path=$dir/imported/checkpoints/0" \
    "base_output_directory=$dir" run_name=trained steps=5 num_vocab_tiling=8 dataset_type=synthetic \
    per_device_batch_size=4 max_target_length=24 eval_interval=0 log_period=1 enable_tensorboard=false
  echo "== $family: export, import again"
  "$python" -m MaxText.checkpoint_conversion.to_huggingface configs/base.yml \
    "load_parameters_path=$dir/trained/checkpoints/5" "hf_output_path=$dir/exported"
  "$python" end_to_end/hf_logits.py "$dir/trained/checkpoints/5" "$hf/golden.npz" --save "$dir/trained.npz"
  "$python" -m MaxText.checkpoint_conversion.to_maxtext configs/base.yml "hf_model_path=$dir/exported" \
    "base_output_directory=$dir" run_name=reimported
  "$python" end_to_end/hf_logits.py "$dir/reimported/checkpoints/0" "$hf/golden.npz" --reference "$dir/trained.npz"
  if [ -n "${HF_PYTHON:-}" ]; then
    echo "== $family: transformers loads the export"
    "$HF_PYTHON" - "$dir/exported" "$hf/golden.npz" "$dir/transformers.npz" <<'EOF'
import sys
import numpy as np
import torch
import transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager").float().eval()
tokens = np.load(sys.argv[2])["tokens"]
with torch.no_grad():
  np.savez(sys.argv[3], tokens=tokens, logits=model(torch.as_tensor(tokens)).logits.numpy())
EOF
    "$python" end_to_end/hf_logits.py "$dir/trained/checkpoints/5" "$hf/golden.npz" --reference "$dir/transformers.npz"
  fi
done
echo "all families: imported with parity, trained, exported and imported again"
