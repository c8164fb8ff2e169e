#!/usr/bin/env python3
"""Reference vectors for gpt-oss as vLLM 0.32 renders it: not its chat template but
openai-harmony, through the steps of vLLM's `_make_request_with_harmony`
(`vllm/renderers/online_renderer.py`): the request validated as vLLM's `ChatCompletionRequest`,
tools dropped only when `tools` is absent, a leading system or developer message peeled off as
instructions, `build_harmony_preamble`, `parse_chat_inputs_to_harmony_messages` and
`render_for_completion` — vLLM's own functions, called in that order. The conversation start
date is frozen at a recorded instant (`now_unix`, UTC), which `shared/tests/harmony.rs`
renders at.

It writes OUT_DIR/gpt-oss-20b-harmony.json: every case of gen_reference.CASES and the
harmony-specific ones below, with the ids, or the error vLLM raises (it answers 400 then).

Usage: TZ=UTC gen_harmony.py OUT_DIR  (in vLLM's own venv: `cargo xtask e2e-vllm` installs it)
"""
import datetime
import json
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))
from gen_reference import CASES  # noqa: E402

import vllm  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.parser.harmony_utils import (  # noqa: E402
    build_harmony_preamble, extract_instructions_from_messages, get_encoding,
    parse_chat_inputs_to_harmony_messages, render_for_completion)
from vllm.tokenizers.mistral import maybe_serialize_tool_calls  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.\nSecond line of the description.",
    "parameters": {"type": "object", "description": "Where and how.", "properties": {
        "zone": {"type": "string", "enum": ["utc", "local"], "default": "utc", "description": "Time zone."},
        "city": {"type": "string", "description": "City name.", "examples": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "default": 3},
        "unit": {"oneOf": [{"type": "string", "enum": ["C", "F"], "description": "Scale."},
                           {"type": "null", "description": "Default scale."}], "description": "Scale."},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ratio": {"type": ["number", "string"], "nullable": True},
        "nested": {"type": "object", "title": "Nested", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
        "anything": {},
        "list": {"type": "array"}},
        "required": ["city"]}}}

HARMONY_CASES = {
    "reasoning_low": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"},
    "reasoning_high_system": {"messages": [{"role": "system", "content": "Sys."}, {"role": "user", "content": "hi"}],
                              "reasoning_effort": "high"},
    "reasoning_bad": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"},
    "second_system": {"messages": [{"role": "system", "content": "First."}, {"role": "user", "content": "u"},
                                   {"role": "system", "content": "Later."}, {"role": "developer", "content": "Dev."},
                                   {"role": "user", "content": "v"}]},
    "system_parts": {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                  {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]},
    "schema_tools": {"messages": [{"role": "user", "content": "Weather?"}],
                     "tools": [WEATHER, {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]},
    "tools_choice_none": {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "tool_choice": "none"},
    "tool_call_reasoning": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "Need the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "unknown", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "It is 21 C.", "reasoning": "Answer now."},
        {"role": "user", "content": "And tomorrow?"}], "tools": [WEATHER]},
    "analysis_kept_after_last_final": {"messages": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first", "reasoning": "dropped"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "", "reasoning": "kept"}]},
    "special_tokens_in_text": {"messages": [
        {"role": "user", "content": "literal <|start|>user<|message|>x<|end|> and <|channel|>final"}]},
    "named_user": {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
    "reasoning_content_alias": {"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "", "reasoning_content": "alias"}]},
    "assistant_parts": {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "user", "content": "r"},
        {"role": "assistant", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hidden"}]},
        {"role": "user", "content": "s"}]},
    "call_with_parts_and_names": {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "ping", "arguments": "{ \"n\" : 1 }"}}]},
        {"role": "tool", "tool_call_id": "x", "content": ""},
        {"role": "user", "content": "again"}],
        "tools": [{"type": "function", "function": {"name": "ping", "description": "", "parameters": {}}}]},
    "empty_instructions_with_tools": {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"}],
                                      "tools": [{"type": "function", "function": {"name": "ping"}}]},
    "schema_shapes": {"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", "function": {
        "name": "shapes", "description": "Line one.\r\nLine two.\n", "parameters": {
            "oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "description": "First form.", "default": {"a": "x"}},
                      {"type": "string", "enum": ["e"], "default": "e", "nullable": True}]}}},
        {"type": "function", "function": {"name": "deep", "parameters": {"type": "object", "required": ["rows"], "properties": {
            "rows": {"type": "array", "description": "Rows.", "items": {"type": "object", "properties": {
                "id": {"type": "integer", "description": "Row id."},
                "kind": {"type": "string", "enum": ["a", 1, "b"], "default": "a"},
                "meta": {"type": "object", "description": "Free form."}}}},
            "mode": {"description": "Same.", "default": "fast", "oneOf": [
                {"type": "string", "description": "Same.", "enum": ["fast"]},
                {"type": "integer", "description": "Other.", "default": 2, "nullable": True}]},
            "flag": {"type": "boolean", "default": False, "nullable": True, "title": "Flag"},
            "choice": {"type": "string", "enum": []},
            "ex": {"type": "number", "examples": [1, "two"]}}}}}]},
}


class FrozenDatetime(datetime.datetime):
    """datetime whose now() is the instant the vectors are pinned to (UTC)."""
    frozen = None

    @classmethod
    def now(cls, tz=None):
        return cls.frozen if tz is None else cls.frozen.astimezone(tz)


def render(req):
    """`_make_request_with_harmony`, step by step (vLLM 0.32, chat completions)."""
    request = ChatCompletionRequest.model_validate({"model": "gpt-oss", **req})
    tool_dicts = None if request.tools is None else [t.model_dump() for t in request.tools]
    maybe_serialize_tool_calls(request)
    instructions, chat_messages = extract_instructions_from_messages(list(request.messages))
    if request.reasoning_effort == "none":
        raise ValueError("Harmony does not support reasoning_effort='none'")
    messages = build_harmony_preamble(instructions=instructions, tools=request.tools if tool_dicts is not None else None,
                                      reasoning_effort=request.reasoning_effort,
                                      with_custom_tools=tool_dicts is not None)
    messages.extend(parse_chat_inputs_to_harmony_messages(chat_messages))
    return render_for_completion(messages)


def main():
    out = sys.argv[1]
    assert not os.environ.get("VLLM_SYSTEM_START_DATE") and not os.environ.get("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS")
    now_unix = int(time.time())
    FrozenDatetime.frozen = FrozenDatetime.fromtimestamp(now_unix, datetime.timezone.utc).replace(tzinfo=None)
    encoding = get_encoding()
    rows = []
    with mock.patch("datetime.datetime", FrozenDatetime):
        for name, req in {**CASES, **HARMONY_CASES}.items():
            row = {"name": name, "request": req}
            try:
                ids = render(req)
                row["ids"] = ids
                row["rendered"] = encoding.decode(ids)
            except Exception as e:  # vLLM answers 400
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    doc = {"generated_by": "tools/parity/gen_harmony.py", "family": "gpt-oss-20b", "vllm": vllm.__version__,
           "now_unix": now_unix, "cases": rows}
    path = os.path.join(out, "gpt-oss-20b-harmony.json")
    with open(path, "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    print(f"{len(rows)} cases ({sum('error' in r for r in rows)} raise) -> {path}")


if __name__ == "__main__":
    main()
