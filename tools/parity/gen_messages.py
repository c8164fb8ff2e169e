#!/usr/bin/env python3
"""Reference vectors for `/v1/messages` (the Anthropic Messages API), the way vLLM 0.32 renders a
Messages request: the body validated as vLLM's own `AnthropicMessagesRequest`, turned into a chat
completion by vLLM's own `AnthropicServingMessages.to_chat_completion_request`, with the two
things vLLM decides per model decided by vLLM's code too: whether inline system messages merge
into the leading system prompt (`_detect_merge_inline_system` on the model's template) and which
`reasoning_effort` stands for `thinking: {"type": "disabled"}` (`_probe_disabled_thinking_effort`:
"low" when the template renders effort "none" like some real effort, or fails on it). The chat is
then rendered as gen_reference.py renders every chat.

It writes OUT_DIR/<model>-messages.json for Qwen3 (models/qwen3-0.6b) and every template family in
../shared/testdata/tokenizers but gpt-oss (vLLM renders it with harmony). A case vLLM refuses is
recorded with the error. Templates that print the date are rendered at `now_unix`.

Usage: TZ=UTC VENV/bin/python tools/parity/gen_messages.py MODELS_QWEN3_DIR TESTDATA_TOKENIZERS_DIR OUT_DIR
"""
import json
import os
import sys
from typing import get_args
from unittest import mock

import transformers

sys.path.insert(0, os.path.dirname(__file__))
from gen_families import FrozenDatetime, case_rows, for_template_models, write_vectors  # noqa: E402
from gen_reference import LONG, render, render_chat  # noqa: E402

from vllm.entrypoints.anthropic.protocol import AnthropicEffort, AnthropicMessagesRequest  # noqa: E402
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages  # noqa: E402
from vllm.renderers.hf import _detect_content_format  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Current weather ünïcode",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

CASES = {
    "string_content": {"messages": [{"role": "user", "content": "Hello!"}]},
    "system_string": {"system": "Be brief.", "messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    "system_blocks_and_billing_header": {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3; cch=abc123"},
                   {"type": "text", "text": "You are a coding agent."},
                   {"type": "text", "text": ""},
                   {"type": "text", "text": " Use the tools.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    "inline_system_reminder": {"system": "Top.", "messages": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one"},
        {"role": "system", "content": [{"type": "text", "text": "<system-reminder>todo list</system-reminder>"}]},
        {"role": "user", "content": "second"}]},
    "inline_system_only_billing": {"messages": [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1"},
        {"role": "user", "content": "q"}]},
    "multi_turn_blocks": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "answer"}]},
        {"role": "user", "content": "again"}]},
    "thinking_blocks": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Add them.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "b64"},
            {"type": "thinking", "thinking": " Four."},
            {"type": "text", "text": "4"}]},
        {"role": "user", "content": "and 3+3?"}]},
    "tool_use_and_result": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "n": 1e3, "u": "é"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "21C"},
            {"type": "text", "text": "And in Tokyo?"}]}]},
    "parallel_tools_and_list_results": {"tools": [WEATHER, {"name": "no_desc", "input_schema": {"properties": {}}}],
                                        "messages": [
        {"role": "user", "content": "Paris and Tokyo?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a",
             "content": [{"type": "text", "text": "21C"}, {"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": [], "is_error": True}]}]},
    "assistant_tool_result_text": {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]},
        {"role": "user", "content": "y"}]},
    "empty_user_dropped": {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": ""}]},
        {"role": "user", "content": "r"}]},
    "tool_choice_any": {"tools": [WEATHER], "tool_choice": {"type": "any"},
                        "messages": [{"role": "user", "content": "Weather?"}]},
    "tool_choice_none": {"tools": [WEATHER], "tool_choice": {"type": "none"},
                         "messages": [{"role": "user", "content": "Weather?"}]},
    "tool_choice_named": {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather",
                                                              "disable_parallel_tool_use": True},
                          "messages": [{"role": "user", "content": "Weather?"}]},
    "tool_strict_and_deferred": {"tools": [{**WEATHER, "strict": True, "defer_loading": False}],
                                 "messages": [{"role": "user", "content": "Weather?"}]},
    "thinking_disabled": {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "2+2?"}]},
    "thinking_enabled": {"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096,
                         "messages": [{"role": "user", "content": "2+2?"}]},
    "thinking_budget_over_max_tokens": {"thinking": {"type": "enabled", "budget_tokens": 2048},
                                        "messages": [{"role": "user", "content": "2+2?"}]},
    "zero_max_tokens": {"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    "thinking_adaptive_effort_high": {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
                                      "messages": [{"role": "user", "content": "2+2?"}]},
    "effort_then_disabled": {"thinking": {"type": "disabled"}, "output_config": {"effort": "max"},
                             "messages": [{"role": "user", "content": "2+2?"}]},
    "kwargs_thinking_off": {"chat_template_kwargs": {"enable_thinking": False},
                            "messages": [{"role": "user", "content": "2+2?"}]},
    "kwargs_thinking_null_and_disabled": {"chat_template_kwargs": {"enable_thinking": None},
                                          "thinking": {"type": "disabled"},
                                          "messages": [{"role": "user", "content": "2+2?"}]},
    "empty_tools": {"tools": [], "messages": [{"role": "user", "content": "Weather?"}]},
    "assistant_last": {"messages": [{"role": "user", "content": "Write a haiku"},
                                    {"role": "assistant", "content": "Autumn moon"}]},
    "long_document": {"system": LONG, "messages": [{"role": "user", "content": "Summarise."}]},
    "unicode_and_special_text": {"messages": [
        {"role": "user", "content": "naïve café 你好 🚀 literal <|im_start|> and <think> tags"}]},
    "sampling_fields_ignored": {"max_tokens": 64, "temperature": 0.2, "top_k": 5, "stream": True,
                                "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
                                "cache_salt": "tenant-a", "messages": [{"role": "user", "content": "hi"}]},
    "missing_max_tokens": {"max_tokens": None, "messages": [{"role": "user", "content": "hi"}]},
    "bad_role": {"messages": [{"role": "tool", "content": "hi"}]},
    "small_thinking_budget": {"thinking": {"type": "enabled", "budget_tokens": 10},
                              "messages": [{"role": "user", "content": "hi"}]},
    "named_choice_without_name": {"tools": [WEATHER], "tool_choice": {"type": "tool"},
                                  "messages": [{"role": "user", "content": "hi"}]},
}

PROBE_EFFORTS = get_args(AnthropicEffort)


def body_of(case):
    body = {"model": "m", "max_tokens": 16, **case}
    return {k: v for k, v in body.items() if v is not None}


def disabled_thinking_effort(tok, fmt, template):
    """vLLM's `_probe_disabled_thinking_effort`, on the chat path gen_reference renders."""
    def probe(effort):
        try:
            return render(tok, {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort}, fmt, template)
        except Exception:
            return None
    none = probe("none")
    if none is None or any(probe(e) == none for e in PROBE_EFFORTS):
        return "low"
    return "none"


def chat_request(body, template, fmt, merge, effort):
    """The chat vLLM renders for a Messages body, as gen_reference.render takes it."""
    request = AnthropicMessagesRequest.model_validate(body)
    thinking_off = request.thinking is not None and request.thinking.type == "disabled"
    req = AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=merge, disabled_thinking_effort=effort if thinking_off else "none")
    kwargs = dict(req.build_chat_params(template, fmt).chat_template_kwargs)
    chat = {"messages": req.messages, "add_generation_prompt": kwargs.pop("add_generation_prompt"),
            "continue_final_message": kwargs.pop("continue_final_message"), "chat_template_kwargs": kwargs}
    if req.tools is not None:
        chat["tools"] = req.tools
    return json.loads(json.dumps(chat, default=lambda o: o.model_dump()))


def write(tok, name, out, now_unix):
    template = tok.chat_template
    fmt = _detect_content_format(template, default="string")
    merge = AnthropicServingMessages._detect_merge_inline_system(template)
    with mock.patch("datetime.datetime", FrozenDatetime):
        effort = disabled_thinking_effort(tok, fmt, template)
    cases = {case: body_of(body) for case, body in CASES.items()}
    rows = case_rows(tok, cases, lambda body: render_chat(tok, chat_request(body, template, fmt, merge, effort), fmt, template))
    doc = {"generated_by": "tools/parity/gen_messages.py", "model": name, "content_format": fmt,
           "merge_inline_system": merge, "disabled_thinking_effort": effort,
           "transformers": transformers.__version__, "now_unix": now_unix, "cases": rows}
    path, errors = write_vectors(out, name, "messages", doc)
    print(f"{name}: {fmt} content, merge {merge}, disabled thinking -> {effort!r}, "
          f"{len(rows)} cases ({errors} raise) -> {path}")


if __name__ == "__main__":
    for_template_models(write)
