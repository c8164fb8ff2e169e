"""Build a tiny, randomly initialised Qwen3ForCausalLM that uses the REAL Qwen3 tokenizer and chat
template (Qwen/Qwen3-0.6B's tokenizer.json + tokenizer_config.json, copied unchanged), so that vLLM
tokenizes prompts exactly like Qwen/Qwen3-0.6B would. No network access needed; deterministic.

usage: python make_qwen3_tiny.py OUT_DIR [TOKENIZER_DIR]
  TOKENIZER_DIR defaults to the repository's vendored models/qwen3-0.6b
  (the official Qwen/Qwen3-0.6B files, checked by sha256 below).
"""
import hashlib, json, os, shutil, sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_common import TINY_SHAPE, copy_checked  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TOK = os.path.join(HERE, "..", "..", "models", "qwen3-0.6b")

if len(sys.argv) < 2:
    sys.exit(__doc__)
out = sys.argv[1]
tok_dir = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_TOK
os.makedirs(out, exist_ok=True)

# --- tokenizer: byte-for-byte copies of the official files (+ licence/attribution) ------------
EXPECTED = {  # sha256 of the official Qwen/Qwen3-0.6B@c1899de files (see SOURCE.md next to them)
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "d5d09f07b48c3086c508b30d1c9114bd1189145b74e982a265350c923acd8101",
}
copy_checked(tok_dir, out, EXPECTED)
for name in ("LICENSE", "NOTICE"):  # Apache-2.0 tokenizer: keep the licence with the copy
    if os.path.exists(os.path.join(tok_dir, name)):
        shutil.copyfile(os.path.join(tok_dir, name), os.path.join(out, name))

tj = json.load(open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8"))
max_id = max([max(tj["model"]["vocab"].values())] + [t["id"] for t in tj["added_tokens"]])
ids = {t["content"]: t["id"] for t in tj["added_tokens"]}
BOS, EOS, PAD = ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"]  # 151643, 151645, 151643
VOCAB = 151936  # Qwen3's padded vocab (real config.json); must be > max token id (151668)
assert max_id < VOCAB, (max_id, VOCAB)
print(f"tokenizer: {len(tj['model']['vocab'])} BPE + {len(tj['added_tokens'])} added tokens, "
      f"max id {max_id}; model vocab_size {VOCAB}")

# --- model --------------------------------------------------------------------------------------
torch.manual_seed(0)
cfg = Qwen3Config(
    vocab_size=VOCAB,
    **TINY_SHAPE,
    head_dim=64,                      # explicit (Qwen3Config defaults to 128); q_proj 64->128, o_proj 128->64
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=2,
    tie_word_embeddings=True,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=PAD,
    dtype="bfloat16",
)
cfg.architectures = ["Qwen3ForCausalLM"]
model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
model.save_pretrained(out, safe_serialization=True)

# Token ids as in Qwen3-0.6B's generation_config.json; its sampling defaults (do_sample, temperature
# 0.6, top_k 20, top_p 0.95) are deliberately left out so that vLLM's defaults stay greedy-capable
# and requests fully control sampling.
gen = {"bos_token_id": BOS, "eos_token_id": [EOS, BOS], "pad_token_id": PAD}
with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(gen, f, indent=2)
    f.write("\n")

print("params", sum(p.numel() for p in model.parameters()))
for name in sorted(os.listdir(out)):
    p = os.path.join(out, name)
    print(f"  {name:24s} {os.path.getsize(p):>10d}  {hashlib.sha256(open(p, 'rb').read()).hexdigest()[:16]}")
