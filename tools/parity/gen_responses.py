#!/usr/bin/env python3
"""Reference vectors for `/v1/responses`, the way vLLM 0.32 renders a Responses request: the
body validated as vLLM's own `ResponsesRequest` (pydantic, the OpenAI SDK's item types), the
chat messages and tools built by vLLM's own `construct_input_messages` and
`construct_tool_dicts`, the template kwargs by `ResponsesRequest.build_chat_params`; then the
chat rendered as gen_reference.py renders every chat (vLLM's normalisation, transformers'
`apply_chat_template`, the tokenizer transformers builds for the model).

It writes OUT_DIR/<model>-responses.json for Qwen3 (models/qwen3-0.6b) and every template
family in ../shared/testdata/tokenizers (gpt-oss is rendered with harmony, which kvgate does not
do for Responses). A case vLLM refuses is recorded with the error. Templates that print the
date are rendered at `now_unix`.

Usage: TZ=UTC target/vllm-venv/bin/python tools/parity/gen_responses.py MODELS_QWEN3_DIR TESTDATA_TOKENIZERS_DIR OUT_DIR
"""
import json
import os
import sys

import transformers

sys.path.insert(0, os.path.dirname(__file__))
from gen_families import case_rows, for_template_models, write_vectors  # noqa: E402
from gen_reference import LONG, render_chat  # noqa: E402

from vllm.entrypoints.openai.responses.protocol import ResponsesRequest  # noqa: E402
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts  # noqa: E402
from vllm.renderers.hf import _detect_content_format  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather ünïcode",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": None}

CASES = {
    "string_input": {"input": "Hello!"},
    "instructions": {"instructions": "Be brief.", "input": "Why is the sky blue?"},
    "empty_instructions": {"instructions": "", "input": "hi"},
    "message_items": {"input": [
        {"role": "system", "content": "Sys."},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Dev rules."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "part one"},
                                                       {"type": "input_text", "text": "part two"}]}]},
    "multi_turn": {"instructions": "Answer in French.", "input": [
        {"role": "user", "content": "first"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "answer one", "annotations": []}]},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer two"},
        {"role": "user", "content": "third"}]},
    "reasoning_and_tools": {"tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should call the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\":\"Paris\",\"n\":1e3}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "{\"temp\": 21}"},
        {"role": "user", "content": "And in Tokyo?"}]},
    "parallel_calls_and_namespaces": {
        "tools": [WEATHER, {"type": "namespace", "name": "crm", "description": "CRM",
                            "tools": [{"type": "function", "name": "find", "description": "Find a customer",
                                       "parameters": {"type": "object", "properties": {}}, "strict": None}]},
                  {"type": "web_search"}],
        "input": [
            {"role": "user", "content": "Weather in Paris and Tokyo, and find Ann?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\":\"Tokyo\"}"},
            {"type": "function_call", "call_id": "c3", "name": "find", "namespace": "crm", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "21C"},
            {"type": "function_call_output", "call_id": "c2", "output": "18C"},
            {"type": "function_call_output", "call_id": "c3", "output": "Ann, #42"}]},
    "summary_reasoning": {"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "summed up"}]},
        {"type": "message", "role": "assistant", "id": "msg_2", "status": "completed",
         "content": [{"type": "output_text", "text": "a", "annotations": []}]},
        {"role": "user", "content": "again"}]},
    "reasoning_effort_low": {"input": "2+2?", "reasoning": {"effort": "low"}},
    "reasoning_effort_none": {"input": "2+2?", "reasoning": {"effort": "none"}},
    "thinking_off_kwargs": {"input": "2+2?", "chat_template_kwargs": {"enable_thinking": False}},
    "continue_partial": {"input": [
        {"role": "user", "content": "Write a haiku"},
        {"type": "message", "role": "assistant", "id": "msg_3", "status": "incomplete",
         "content": [{"type": "output_text", "text": "Autumn moon  ", "annotations": []}]}]},
    "long_document": {"instructions": LONG, "input": "Summarise."},
    "unicode_and_special_text": {"input": "naïve café 你好 🚀 literal <|im_start|> and <think> tags"},
    "only_builtin_tools": {"input": "Search the web for kv caches.", "tools": [{"type": "web_search"}]},
    "message_item_name_dropped": {"input": [{"type": "message", "role": "user", "name": "ann", "content": "hi"}]},
    "previous_input_messages_ignored": {"input": "hi", "previous_input_messages": [{"role": "user", "content": "x"}]},
    "prompt_template_refused": {"input": "hi", "prompt": {"id": "pmpt_1"}},
    "empty_encrypted_reasoning": {"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": "",
         "content": [{"type": "reasoning_text", "text": "plain"}]},
        {"role": "user", "content": "again"}]},
    "sampling_fields_ignored": {"input": "hi", "max_output_tokens": 64, "temperature": 0.2, "stream": True,
                                "user": "u1", "cache_salt": "tenant-a", "store": False},
}


def chat_request(body, template, fmt):
    """The chat vLLM renders for a Responses body, as gen_reference.render takes it."""
    request = ResponsesRequest.model_validate({"model": "m", **body})
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    tools = construct_tool_dicts(request.tools, request.tool_choice)
    kwargs = dict(request.build_chat_params(template, fmt).chat_template_kwargs)
    chat = {"messages": messages, "add_generation_prompt": kwargs.pop("add_generation_prompt"),
            "continue_final_message": kwargs.pop("continue_final_message"), "chat_template_kwargs": kwargs}
    if tools is not None:
        chat["tools"] = tools
    return json.loads(json.dumps(chat, default=lambda o: o.model_dump()))


def write(tok, name, out, now_unix):
    template = tok.chat_template
    fmt = _detect_content_format(template, default="string")
    rows = case_rows(tok, CASES, lambda body: render_chat(tok, chat_request(body, template, fmt), fmt, template))
    doc = {"generated_by": "tools/parity/gen_responses.py", "model": name, "content_format": fmt,
           "transformers": transformers.__version__, "now_unix": now_unix, "cases": rows}
    path, errors = write_vectors(out, name, "responses", doc)
    print(f"{name}: {fmt} content, {len(rows)} cases ({errors} raise) -> {path}")


if __name__ == "__main__":
    for_template_models(write)
