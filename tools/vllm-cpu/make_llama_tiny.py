"""Build a tiny, randomly initialised LlamaForCausalLM on the REAL Llama 3.2 tokenizer and chat
template (meta-llama/Llama-3.2-1B-Instruct's tokenizer.json + tokenizer_config.json from the
shared test data, copied unchanged and checked by sha256), so that vLLM renders and tokenizes
prompts exactly like Llama 3.2 Instruct would: a second model family for `cargo xtask e2e-vllm`
(its template prints today's date with strftime_now). No network access needed; deterministic.

usage: python make_llama_tiny.py OUT_DIR TOKENIZER_DIR
  TOKENIZER_DIR: ../shared/testdata/tokenizers/llama-3.2-1b-instruct (Llama 3.2 Community
  License; test data, never shipped: the built model stays under target/)
"""
import json, os, sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_common import TINY_SHAPE, copy_checked  # noqa: E402

if len(sys.argv) < 3:
    sys.exit(__doc__)
out, tok_dir = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)

EXPECTED = {  # sha256 of the official files (SOURCE.md next to them)
    "tokenizer.json": "79e3e522635f3171300913bb421464a87de6222182a0570b9b2ccba2a964b2b4",
    "tokenizer_config.json": "9823dcfdc1121869029da45192238e85cf44f0b232a6d9dc20e4fe6f4242a14e",
}
copy_checked(tok_dir, out, EXPECTED)

tj = json.load(open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8"))
ids = {t["content"]: t["id"] for t in tj["added_tokens"]}
BOS, EOT, EOM, END = ids["<|begin_of_text|>"], ids["<|eot_id|>"], ids["<|eom_id|>"], ids["<|end_of_text|>"]
VOCAB = 128256  # Llama 3.2's vocab_size (real config.json)

torch.manual_seed(0)
cfg = LlamaConfig(
    vocab_size=VOCAB,
    **TINY_SHAPE,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=True,
    bos_token_id=BOS,
    eos_token_id=[END, EOM, EOT],
    dtype="bfloat16",
)
cfg.architectures = ["LlamaForCausalLM"]
model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
model.save_pretrained(out, safe_serialization=True)
with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": BOS, "eos_token_id": [END, EOM, EOT]}, f, indent=2)
    f.write("\n")
print("params", sum(p.numel() for p in model.parameters()))
