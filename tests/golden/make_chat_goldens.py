"""Render chat conversations with transformers' own `apply_chat_template` and the released chat
templates (flashrt/assets/chat_templates), and store the prompts in tests/golden/chat/<name>.json.
tests/test_chat_template.py checks that flashrt.chat renders every one of them exactly.

Each case is what an OpenAI client sends (content null, arguments as JSON strings, ...). It is
rendered twice: prepared by flashrt.chat.prepare_messages ("prompt"), and as sent ("raw": the
prompt, or the error the template raised). The tokenizer is built here, without a hub: the chat
tokenizer make_checkpoint(chat=True) writes (its named special tokens are the released ones).

Run once (the goldens are kept in the repo; rerun only to add cases):
    PYTHONPATH=. .venv/bin/python tests/golden/make_chat_goldens.py
"""
from __future__ import annotations

import copy
import json
import pathlib
import sys
import tempfile

import transformers
from transformers import AutoTokenizer

from flashrt.chat import prepare_messages
from flashrt.models.checkpoint import CHAT_TEMPLATES, write_chat_tokenizer

OUT = pathlib.Path(__file__).resolve().parent / "chat"
# golden name -> (template file, arch whose tokenizer it ships with, prepare_messages family)
TEMPLATES = {"qwen3-0.6b": ("qwen3-0.6b.jinja", "qwen3", "qwen3"),
             "qwen3_5": ("qwen3_5.jinja", "qwen3_5", "qwen3_5"),
             "qwen3_5-0.8b": ("qwen3_5-0.8b.jinja", "qwen3_5", "qwen3_5"),
             "lfm2-350m": ("lfm2-350m.jinja", "lfm2", "lfm2")}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web; résumé of the top hits.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
            "cursor": {"type": ["string", "null"]}, "filters": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["query"], "additionalProperties": False}, "strict": True}},
]
WEATHER = '{"city": "Paris", "unit": "celsius"}'           # as LangChain re-dumps it
WEATHER_COMPACT = '{"city":"Paris","unit":"celsius"}'      # as pydantic-ai compacts it
LITERALS = ('{"query": "cafés près du Louvre", "limit": 3, "exact": true, "cursor": null, '
            '"strict": false, "filters": {"open": true, "price": null}, "tags": ["a", "b"]}')


def call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


USER = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", WEATHER)]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'}

CASES = [
    dict(name="plain", messages=[{"role": "user", "content": "Hi"}]),
    dict(name="system_multi_turn", messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]),
    dict(name="content_parts", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]}]),
    dict(name="developer_role", messages=[
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]),
    dict(name="tools_offered", tools=TOOLS, messages=[{"role": "system", "content": "You are terse."}, USER]),
    dict(name="tools_offered_no_system", tools=TOOLS, messages=[USER]),
    dict(name="tool_call_content_null", tools=TOOLS, messages=[USER, CALLED, RESULT]),
    dict(name="tool_call_compact_arguments", tools=TOOLS, messages=[
        USER, {**CALLED, "tool_calls": [call("call_1", "get_weather", WEATHER_COMPACT)]}, RESULT]),
    dict(name="tool_call_with_content", tools=TOOLS, messages=[
        USER, {**CALLED, "content": "Let me check."}, RESULT]),
    dict(name="parallel_calls", tools=TOOLS, messages=[
        USER, {"role": "assistant", "content": None, "tool_calls": [
            call("call_1", "get_weather", WEATHER), call("call_2", "search", '{"query": "Paris museums"}')]},
        RESULT, {"role": "tool", "tool_call_id": "call_2", "content": "Louvre; Orsay"}]),
    dict(name="json_literals", tools=TOOLS, messages=[
        USER, {"role": "assistant", "content": None, "tool_calls": [call("call_1", "search", LITERALS)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "[]"}]),
    dict(name="no_arguments", tools=TOOLS, messages=[
        USER, {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", "{}")]},
        RESULT]),
    dict(name="reasoning_kept", tools=TOOLS, messages=[
        USER, {**CALLED, "reasoning_content": "The user wants the weather; call get_weather."}, RESULT]),
    dict(name="reasoning_dropped", tools=TOOLS, messages=[USER, CALLED, RESULT]),
    dict(name="reasoning_history", add_generation_prompt=False, messages=[
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Add again."}]),
    dict(name="reasoning_in_content", add_generation_prompt=False, messages=[
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}]),
    dict(name="thinking_on", template_kwargs={"enable_thinking": True}, messages=[USER]),
    dict(name="thinking_off", template_kwargs={"enable_thinking": False}, messages=[USER]),
    dict(name="thinking_off_tool_loop", tools=TOOLS, template_kwargs={"enable_thinking": False},
         messages=[USER, CALLED, RESULT]),
    dict(name="reasoning_effort_none", request={"reasoning_effort": "none"},
         template_kwargs={"enable_thinking": False, "reasoning_effort": "none"}, messages=[USER]),
    dict(name="reasoning_effort_high", request={"reasoning_effort": "high"},
         template_kwargs={"enable_thinking": True, "reasoning_effort": "high"}, messages=[USER]),
]


def render(tok, template, case, messages):
    try:
        return {"prompt": tok.apply_chat_template(
            messages, tools=case.get("tools"), chat_template=template, tokenize=False,
            add_generation_prompt=case.get("add_generation_prompt", True), **case.get("template_kwargs", {}))}
    except Exception as e:                              # noqa: BLE001 (the golden records it)
        return {"error": type(e).__name__}


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, (file, arch, family) in TEMPLATES.items():
        template = (CHAT_TEMPLATES / file).read_text(encoding="utf-8")
        with tempfile.TemporaryDirectory() as d:
            write_chat_tokenizer(arch, d)
            tok = AutoTokenizer.from_pretrained(d)
        cases = []
        for case in CASES:
            prepared = prepare_messages(copy.deepcopy(case["messages"]), family)
            got = render(tok, template, case, prepared)
            if "error" in got:
                raise SystemExit(f"{name}/{case['name']}: transformers refused the prepared messages: {got}")
            cases.append({**case, "prepared": prepared, "prompt": got["prompt"],
                          "raw": render(tok, template, case, copy.deepcopy(case["messages"]))})
        doc = {"template": file, "family": family, "transformers": transformers.__version__,
               "special_tokens": tok.special_tokens_map, "cases": cases}
        (OUT / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"{name}: {len(cases)} cases -> {OUT / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
