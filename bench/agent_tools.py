"""The agent benches' shared fixtures (bench/agent.py, bench/agent_resume.py): the loop's tools,
its prompt and the tools' fixed results, and one streamed OpenAI-style request read back."""
from __future__ import annotations

import json
import time

TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the user's notes; returns one page of hits",
        "parameters": {"type": "object", "properties": {"page": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["page"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "weather", "description": "The forecast at the user's destination",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "clock", "description": "The current date and time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]
SYSTEM = ("You are a research assistant. Use the tools to find out what you need, one call at a time, "
          "then answer in one sentence.")
QUESTION = "Which of my trip notes is the newest, and will it rain while I am away?"


def run_tool(name: str, args: dict) -> str:
    """The tools' results: fixed text per call (the loop's point is the prompt, not the answer)."""
    if name == "search":
        k = args["page"]
        return f"page {k}: 3 notes match 'trip'; the newest is note {40 + k}, dated 2024-05-0{k}"
    if name == "weather":
        return f"next {args['days']} days: 21 C, dry, wind 12 km/h; rain chance 10%"
    return "2024-05-03 14:05 UTC"


def stream(client, url: str, body: dict) -> dict:
    """One streamed request: TTFT (first chunk with a choice), token ids, the folded tool calls
    (the first delta of a call names it, later ones add argument text), finish reason, usage."""
    ttft, ids, usage, finish, calls, text = None, [], None, None, {}, []
    t0 = time.perf_counter()
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"POST {url}: {r.status_code} {r.text[:800]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if not ev.get("choices"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            c = ev["choices"][0]
            ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
            d = c.get("delta")
            if d is None:                                  # a text completion
                text.append(c.get("text") or "")
                continue
            text.append(d.get("content") or "")
            for t in d.get("tool_calls") or ():
                call = calls.setdefault(t["index"], {"id": t.get("id"), "name": t["function"].get("name"),
                                                     "arguments": ""})
                call["arguments"] += t["function"].get("arguments") or ""
    if ttft is None:
        raise RuntimeError(f"POST {url}: the stream held no chunk")
    return {"ttft": ttft, "ids": ids, "usage": usage, "finish": finish, "text": "".join(text),
            "calls": [calls[i] for i in sorted(calls)]}


def cached_of(res) -> int:
    return res["usage"]["prompt_tokens_details"]["cached_tokens"]
