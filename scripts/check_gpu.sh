#!/usr/bin/env bash
# The isolation self-check on a GPU, offline: GSM8K (embedded) packed with the default Mistral
# tokenizer, and a random-init Llama of 0.51B parameters saved with save_pretrained.
#   bash scripts/check_gpu.sh [WORKDIR]
# Expected: "ok" for flash_attn (varpack_fa2, needs flash-attn), torch_varlen (varpack_varlen) and
# sdpa without a cache; "FAILED: config.use_cache=True" for sdpa with the config's cache.
set -uo pipefail
work=${1:-/tmp/varpack-check}
python -m pipeline.pack --out "$work/shards" --no-progress >/dev/null || exit 1
python - "$work/model" <<'PY' || exit 1
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
PY
check() { echo "--attn $*: $(python -m loaders.check --model "$work/model" --shards "$work/shards" --attn "$@" 2>&1 | tail -1)"; }
check flash_attn --no-cache
check torch_varlen --no-cache
check sdpa --no-cache
check sdpa
