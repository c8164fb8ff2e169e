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
