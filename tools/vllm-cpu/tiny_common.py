"""What the tiny-model builders share: copying the real tokenizer files, checked by sha256."""
import hashlib
import os
import shutil
import sys


def copy_checked(tok_dir, out, expected):
    """Copies each file of `expected` ({name: sha256}) from `tok_dir` to `out`, or exits."""
    for name, want in expected.items():
        src = os.path.join(tok_dir, name)
        got = hashlib.sha256(open(src, "rb").read()).hexdigest()
        if got != want:
            sys.exit(f"{src}: sha256 {got} != expected {want}")
        shutil.copyfile(src, os.path.join(out, name))


# The shape both tiny models share: two layers of width 64, one KV head.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    hidden_act="silu",
    max_position_embeddings=4096,
)
