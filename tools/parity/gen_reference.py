#!/usr/bin/env python3
"""Writes reference token ids for chat requests, rendered the way vLLM 0.32 renders them.

vLLM's renderer (see docs/chat-rendering.md) normalises the OpenAI request,
then calls transformers' `apply_chat_template(tokenize=False)` and encodes the text with
`add_special_tokens=False`. This script applies the same normalisation (content parts joined
with "\\n" for string-format templates, or every content a list of text parts for
templates that iterate content ("openai" format), tool-call arguments parsed into objects, tools in
canonical key order, system/developer messages merged first, kwargs precedence) and then
uses the real transformers + tokenizers, so kvgate's Rust pipeline (minijinja + tokenizers-rs)
is checked against Python's Jinja2 and HF's own code.

Usage: gen_reference.py MODEL_DIR OUT_DIR   (needs: pip install transformers tokenizers jinja2; no torch)
"""
import json
import sys

from transformers import AutoTokenizer

TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")


def content_text(content):
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            t = part
        else:
            kind = part.get("type")
            t = part.get({"refusal": "refusal", "thinking": "thinking"}.get(kind, "text")) if kind in TEXT_PARTS else None
        if t:
            texts.append(t)
    return "\n".join(texts)


def part_texts(content):
    """The texts of a list content's text parts, empty ones kept (vLLM's "openai" format)."""
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        else:
            kind = part.get("type")
            texts.append(part.get({"refusal": "refusal", "thinking": "thinking"}.get(kind, "text")) or "")
    return texts


def shaped_content(role, content, fmt):
    if fmt == "string" or role == "tool":
        return content_text(content)
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": t} for t in part_texts(content)]


def normalize_message(m, fmt):
    out = {"role": m["role"], "content": shaped_content(m["role"], m.get("content"), fmt)}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if m["role"] == "assistant":
        calls = m.get("tool_calls") or []
        if calls:
            norm = []
            for c in calls:
                c = dict(c)
                f = dict(c["function"])
                try:
                    args = json.loads(f["arguments"])
                    if not isinstance(args, dict):
                        args = {}
                except (ValueError, TypeError):
                    args = {}
                f["arguments"] = args
                c["function"] = f
                norm.append(c)
            out["tool_calls"] = norm
        reasoning = m.get("reasoning", m.get("reasoning_content"))
        if isinstance(reasoning, str):
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def normalize_tool(t):
    f = t["function"]
    fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
    for k in ("strict", "defer_loading"):
        if f.get(k) is not None:
            fn[k] = f[k]
    return {"type": "function", "function": fn}


def consolidate(messages, template):
    """vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`, which it runs
    only when a developer message meets a template that does not know the role."""
    knows_developer = '"developer"' in template or "'developer'" in template
    if knows_developer or not any(m["role"] == "developer" for m in messages):
        return messages
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    system, rest, needs = [], [], False
    for i, m in enumerate(messages):
        if m["role"] == "system":
            needs = needs or i > 0 or bool(system)
            content = m.get("content", "")
            if isinstance(content, list):
                content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
            if content:
                system.append(content)
        else:
            rest.append(m)
    if not needs:
        return messages
    return [{"role": "system", "content": "\n\n".join(system)}] + rest


def render(tok, req, fmt="string", template=None):
    kwargs = {k: v for k, v in (req.get("chat_template_kwargs") or {}).items() if v is not None and v != "auto"}
    for k in ("documents", "reasoning_effort"):
        if req.get(k) not in (None, "auto"):
            kwargs[k] = req[k]
    if isinstance(req.get("reasoning_effort"), str) and "enable_thinking" not in (req.get("chat_template_kwargs") or {}):
        kwargs["enable_thinking"] = req["reasoning_effort"] != "none"
    kwargs["add_generation_prompt"] = req.get("add_generation_prompt", True)
    kwargs["continue_final_message"] = req.get("continue_final_message", False)
    template = template or tok.chat_template
    messages = [normalize_message(m, fmt) for m in req["messages"]]
    messages = consolidate(messages, template)
    tools = [normalize_tool(t) for t in req["tools"]] if req.get("tools") else None
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=template, **kwargs)


def render_chat(tok, chat, fmt, template):
    """render(), except that an empty tool list reaches the template as one, as vLLM hands it
    over (render() reads an empty list as no tools)."""
    if chat.get("tools") != []:
        return render(tok, chat, fmt, template)
    apply = tok.apply_chat_template
    tok.apply_chat_template = lambda *args, **kwargs: apply(*args, **{**kwargs, "tools": kwargs.get("tools") or []})
    try:
        return render(tok, chat, fmt, template)
    finally:
        del tok.apply_chat_template


LONG = " ".join(f"paragraph {i}: the router keeps prefix blocks warm across replicas." for i in range(300))

CASES = {
    "plain": {"messages": [{"role": "user", "content": "Hello!"}]},
    "system_user": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]},
    "thinking_off": {"messages": [{"role": "user", "content": "2+2?"}], "chat_template_kwargs": {"enable_thinking": False}},
    "reasoning_effort_none": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"},
    "multi_turn_think": {"messages": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nreasoning here\n</think>\n\nanswer one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer two", "reasoning": "more thoughts"},
        {"role": "user", "content": "third"}]},
    "content_parts": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "part one"}, {"type": "text", "text": ""}, {"type": "text", "text": "part two"}]}]},
    "empty_and_null": {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": None},
                                    {"role": "assistant", "content": ""}, {"role": "user", "content": " "}]},
    "unicode": {"messages": [{"role": "user", "content": "naïve café 你好，世界 🚀🔥 e\u0301 \u00e9 ß ﬁ"}]},
    "special_text": {"messages": [{"role": "user", "content": "literal <|im_start|> and <|im_end|> and <think> tags"}]},
    "tools": {
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"unit\":\"C\",\"n\":1e3}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "extra"}, {"type": "text", "text": "lines"}]},
            {"role": "user", "content": "And in Tokyo?"}],
        "tools": [
            {"type": "function", "function": {"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                                              "name": "get_weather", "description": "Current weather ünïcode"}},
            {"type": "function", "function": {"name": "no_params"}}]},
    "developer_role": {"messages": [{"role": "developer", "content": "Dev rules."}, {"role": "system", "content": "Sys."}, {"role": "user", "content": "x"}]},
    "continue_final": {"messages": [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moon  "}],
                       "add_generation_prompt": False, "continue_final_message": True},
    "no_generation_prompt": {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
    "long_document": {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarise."}]},
    "whitespace": {"messages": [{"role": "user", "content": "  lead\n\n\ttabs\r\nwindows  \n"}]},
}


# A template that iterates content parts, so vLLM hands it "openai"-format content: every
# content a list of text parts, empty parts kept (the separator makes them visible).
PARTS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}{{- part.text }}{%- if not loop.last %}{{- ' | ' }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PARTS_CASES = {name: CASES[name] for name in (
    "plain", "system_user", "content_parts", "empty_and_null", "tools", "developer_role", "continue_final", "unicode")}


def write(tok, out, cases, fmt, template=None):
    rows = []
    for name, req in cases.items():
        text = render(tok, req, fmt, template)
        ids = tok.encode(text, add_special_tokens=False)
        rows.append({"name": name, "request": req, "rendered": text, "ids": ids})
    doc = {"generated_by": "tools/parity/gen_reference.py", "content_format": fmt, "cases": rows}
    if template:
        doc["chat_template"] = template
    with open(out, "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    print(f"wrote {len(rows)} cases to {out}")


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(model_dir)
    write(tok, f"{out_dir}/qwen3-chat.json", CASES, "string")
    write(tok, f"{out_dir}/openai-format-chat.json", PARTS_CASES, "openai", PARTS_TEMPLATE)


if __name__ == "__main__":
    main()
