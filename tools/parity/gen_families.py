#!/usr/bin/env python3
"""Reference vectors for every model family in ../shared/testdata/tokenizers, the way vLLM 0.32
renders a chat: gen_reference.py's normalisation with the content format vLLM detects from the
template (its own `_detect_content_format`), then transformers' apply_chat_template and the
tokenizer transformers builds for the model (AutoTokenizer, as vLLM loads it). The model is
loaded from a copy of its directory with a `config.json` naming its `model_type`, as a real
model repository has: without one, transformers 5 picks the tokenizer class from
`tokenizer_config.json` (`LlamaTokenizer` for DeepSeek-V3 and Phi-3.5) and tokenizes unlike the
engine.

gpt-oss: vLLM renders it with openai-harmony, not its template; these vectors check kvgate's
template path only.

For each family it writes OUT_DIR/<family>-chat.json: every case of gen_reference.CASES with
the rendered text and ids, or the error the template raised (vLLM answers 400 then). Templates
that print today's date (strftime_now) are rendered at a recorded instant, `now_unix`, so a test
can render at the same instant.

Usage: TZ=UTC gen_families.py TESTDATA_TOKENIZERS_DIR OUT_DIR
(needs transformers, tokenizers and jinja2; vLLM's own venv has the versions it runs with)
"""
import datetime
import json
import os
import sys
import tempfile
import time
from unittest import mock

import transformers
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(__file__))
from gen_reference import CASES, render  # noqa: E402

from vllm.renderers.hf import _detect_content_format  # noqa: E402

# Each family and the `model_type` of its model's config.json.
FAMILIES = {"llama-3.2-1b-instruct": "llama", "gpt-oss-20b": "gpt_oss", "deepseek-v3": "deepseek_v3",
            "gemma-3-1b-it": "gemma3_text", "mistral-nemo-instruct-2407": "mistral",
            "phi-3.5-mini-instruct": "phi3"}


def model_dir(src, family, model_type, tmp):
    """A directory with the family's files and a config.json, as a model repository has."""
    d = os.path.join(tmp, family)
    os.makedirs(d)
    for name in os.listdir(os.path.join(src, family)):
        os.symlink(os.path.join(src, family, name), os.path.join(d, name))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": model_type}, f)
    return d


class FrozenDatetime(datetime.datetime):
    """datetime whose now() is the instant the vectors are pinned to (UTC)."""
    frozen = None

    @classmethod
    def now(cls, tz=None):
        return cls.frozen if tz is None else cls.frozen.astimezone(tz)


def freeze_now():
    """Pins the date templates print to now (UTC); returns it in seconds since the epoch."""
    now_unix = int(time.time())
    FrozenDatetime.frozen = FrozenDatetime.fromtimestamp(now_unix, datetime.timezone.utc).replace(tzinfo=None)
    return now_unix


def template_models(qwen3, families):
    """(tokenizer, name) for Qwen3 and every family vLLM renders with its template (all but
    gpt-oss, which it renders with harmony)."""
    yield AutoTokenizer.from_pretrained(qwen3), "qwen3"
    tmp = tempfile.mkdtemp()
    for family, model_type in FAMILIES.items():
        if model_type != "gpt_oss":
            yield AutoTokenizer.from_pretrained(model_dir(os.path.abspath(families), family, model_type, tmp)), family


def case_rows(tok, cases, render_case):
    """Each case's request with the text `render_case(request)` gives and its ids, or the error
    it raised (vLLM answers 400 then), at the frozen date."""
    rows = []
    with mock.patch("datetime.datetime", FrozenDatetime):
        for name, request in cases.items():
            row = {"name": name, "request": request}
            try:
                text = render_case(request)
                row["rendered"] = text
                row["ids"] = tok.encode(text, add_special_tokens=False)
            except Exception as e:  # vLLM answers 400
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    return rows


def write_vectors(out, name, kind, doc):
    """Writes OUT/<name>-<kind>.json; returns its path and how many of its cases raise."""
    path = os.path.join(out, f"{name}-{kind}.json")
    with open(path, "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    return path, sum("error" in r for r in doc["cases"])


def for_template_models(write):
    """`write(tok, name, out, now_unix)` for Qwen3 and every template family, from the command
    line's MODELS_QWEN3_DIR TESTDATA_TOKENIZERS_DIR OUT_DIR, at one frozen instant."""
    qwen3, families, out = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out, exist_ok=True)
    now_unix = freeze_now()
    for tok, name in template_models(qwen3, families):
        write(tok, name, out, now_unix)


def main():
    src, out = os.path.abspath(sys.argv[1]), sys.argv[2]
    os.makedirs(out, exist_ok=True)
    now_unix = freeze_now()
    tmp = tempfile.mkdtemp()
    for family, model_type in FAMILIES.items():
        tok = AutoTokenizer.from_pretrained(model_dir(src, family, model_type, tmp))
        template = tok.chat_template
        fmt = _detect_content_format(template, default="string")
        rows = case_rows(tok, CASES, lambda req: render(tok, req, fmt, template))
        doc = {"generated_by": "tools/parity/gen_families.py", "family": family, "content_format": fmt,
               "tokenizer_class": type(tok).__name__, "transformers": transformers.__version__,
               "now_unix": now_unix, "cases": rows}
        path, errors = write_vectors(out, family, "chat", doc)
        print(f"{family}: {type(tok).__name__}, {fmt} content, {len(rows)} cases ({errors} raise) -> {path}")


if __name__ == "__main__":
    main()
