"""flashrt serve's Responses API (/v1/responses) against a real uvicorn server and the official
openai client: text and forced tool calls, streamed and not; previous_response_id continuing a
stored response's token history exactly (cached_tokens covers it) and forking it; GET / DELETE;
cancel; 400s naming the parameter. Tiny random-weight checkpoint with Qwen3's chat template
(make_checkpoint(chat=True)): the text is meaningless; shapes, grammar guarantees and cache
accounting are what is checked."""
from __future__ import annotations

import importlib.util
import json
from typing import Literal

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
if not hasattr(openai.OpenAI, "responses"):     # the Responses client came in openai 1.66
    pytest.skip("needs an openai client with responses", allow_module_level=True)

from serve_util import Server  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for some days",
           "parameters": {"type": "object", "properties": {
               "days": {"type": "integer", "minimum": 1, "maximum": 7}, "metric": {"type": "boolean"}},
               "required": ["days", "metric"], "additionalProperties": False}, "strict": True}
needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="needs xgrammar")


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt("qwen3", "tiny", chat=True), "--max-sessions", "2", "--max-seq-len", "2048")
    yield s
    s.stop()


def create(server, **body) -> dict:
    r = server.post("/v1/responses", {"model": server.model, **body})
    assert r.status_code == 200, r.text
    return r.json()


def weather_call(item) -> dict:
    """A function_call item of WEATHER whose arguments follow its schema; the arguments."""
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    args = json.loads(item.arguments)
    assert set(args) == {"days", "metric"} and type(args["days"]) is int and 1 <= args["days"] <= 7
    assert type(args["metric"]) is bool
    return args


def test_text_response_retrieve_delete(server):
    c = server.client()
    r = c.responses.create(model=server.model, input="Hello there", instructions="Be brief.",
                           max_output_tokens=6, temperature=0)
    assert r.id.startswith("resp") and r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.usage.output_tokens == 6
    assert r.output_text == r.output[0].content[0].text
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.instructions == "Be brief."
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):       # gone for continuations too
        c.responses.create(model=server.model, input="more", previous_response_id=r.id)
    r2 = c.responses.create(model=server.model, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r2.id)


@needs_xgrammar
def test_contract_prefix_continuation_tool_call_then_output_chain(server):
    """tool_choice required: a schema-valid function_call; its function_call_output continued by
    previous_response_id prefills only the new input: cached_tokens covers the whole history."""
    c = server.client()
    first = c.responses.create(model=server.model, input="Weather?", tools=[WEATHER], tool_choice="required",
                               parallel_tool_calls=False, temperature=0, max_output_tokens=300)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    weather_call(calls[0])
    history = first.usage.input_tokens + first.usage.output_tokens
    for field, value in (("tools", []), ("instructions", "Be brief.")):   # the history holds the first's
        r = server.post("/v1/responses", {"previous_response_id": first.id, "input": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    nxt = c.responses.create(model=server.model, previous_response_id=first.id, tools=[WEATHER],
                             input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                     "output": "sunny"}], max_output_tokens=4, temperature=0)
    assert nxt.previous_response_id == first.id
    assert nxt.usage.input_tokens > history
    assert nxt.usage.input_tokens_details.cached_tokens >= history
    # a third turn on top of the second: the chain keeps continuing exactly
    third = c.responses.create(model=server.model, previous_response_id=nxt.id, input="thanks",
                               max_output_tokens=2, temperature=0)
    assert third.usage.input_tokens_details.cached_tokens >= nxt.usage.input_tokens + nxt.usage.output_tokens


def test_contract_fork_determinism_forks_independent_under_one_seed(server):
    """Two requests naming one response are two forks of it; under one seed the same fork gives
    the same text, and each fork's continuation reuses the shared history."""
    c = server.client()
    base = c.responses.create(model=server.model, input="Tell me a story", max_output_tokens=5, temperature=0)
    history = base.usage.input_tokens + base.usage.output_tokens

    def fork(text, seed):
        return c.responses.create(model=server.model, previous_response_id=base.id, input=text,
                                  max_output_tokens=8, temperature=1.0, extra_body={"seed": seed})
    a1, b1, a2 = fork("a dragon", 7), fork("a robot", 7), fork("a dragon", 7)
    assert a1.output_text == a2.output_text and a1.usage.input_tokens == a2.usage.input_tokens
    assert a1.usage.input_tokens != b1.usage.input_tokens or a1.output_text != b1.output_text
    for r in (a1, b1, a2):
        assert r.usage.input_tokens_details.cached_tokens >= history
    # the forks are stored apart: continuing one does not see the other
    a3 = c.responses.create(model=server.model, previous_response_id=a1.id, input="go on",
                            max_output_tokens=2, temperature=0)
    assert a3.usage.input_tokens_details.cached_tokens >= a1.usage.input_tokens + a1.usage.output_tokens


@needs_xgrammar
def test_streamed_events(server):
    c = server.client()
    events = list(c.responses.create(model=server.model, input="Weather?", tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, temperature=0, max_output_tokens=300, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_item.added" in types and "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments
    final = events[-1].response
    weather_call(final.output[-1])
    assert final.output[-1].arguments == done.arguments
    assert c.responses.retrieve(final.id).output[-1].call_id == final.output[-1].call_id
    # text: deltas add up to the done text and the stored output
    events = list(c.responses.create(model=server.model, input="Hi", max_output_tokens=24, temperature=0, stream=True))
    types = [e.type for e in events]
    for t in ("response.content_part.added", "response.output_text.delta", "response.output_text.done",
              "response.output_item.done"):
        assert t in types, t
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == next(e for e in events if e.type == "response.output_text.done").text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == text


def test_cancel_keeps_delivered(server):
    """Barge-in: a finished response cut to its first 2 tokens continues from those."""
    c = server.client()
    r = c.responses.create(model=server.model, input="Count", max_output_tokens=6, temperature=0)
    cut = server.post(f"/v1/responses/{r.id}/cancel", {"delivered_tokens": 2})
    assert cut.status_code == 200 and cut.json()["kept_tokens"] == [2], cut.text
    assert c.responses.retrieve(r.id).status == "cancelled"
    nxt = c.responses.create(model=server.model, previous_response_id=r.id, input="more",
                             max_output_tokens=2, temperature=0)
    assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + 2


@needs_xgrammar
def test_json_schema_format(server):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]},
                                               "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    r = server.client().responses.create(
        model=server.model, input="Pick", temperature=0, max_output_tokens=200, reasoning={"effort": "minimal"},
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    value = json.loads(r.output_text)
    assert set(value) == {"color", "ok"} and value["color"] in ("red", "blue") and type(value["ok"]) is bool
    assert r.status == "completed" and r.text.format.type == "json_schema"


def test_streamed_cancel_keeps_delivered(server):
    """Barge-in on a stream: cancel after the first text delta, keeping 2 tokens; the response
    ends cancelled and continues from those 2 tokens."""
    c = server.client()
    rid, kept, last = None, None, None
    with c.responses.create(model=server.model, input="Hi", max_output_tokens=400, temperature=0,
                            stream=True) as events:
        for e in events:
            if e.type == "response.created":
                rid = e.response.id
            elif e.type == "response.output_text.delta" and kept is None:
                kept = server.post(f"/v1/responses/{rid}/cancel", {"delivered_tokens": 2})
            last = e
    assert kept.status_code == 200 and kept.json()["kept_tokens"] == [2], kept.text
    assert last.response.status == "cancelled" or c.responses.retrieve(rid).status == "cancelled"
    nxt = c.responses.create(model=server.model, previous_response_id=rid, input="more",
                             max_output_tokens=1, temperature=0)
    assert nxt.usage.input_tokens_details.cached_tokens >= last.response.usage.input_tokens + 2


BAD = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "get weather"}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "temperature": 3}, "temperature"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_names_parameter(server, body, param):
    r = server.post("/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_ids(server):
    r = server.post("/v1/responses", {"input": "x", "previous_response_id": "resp-nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert httpx.delete(server.url + "/v1/responses/resp-nope").status_code == 404
    assert httpx.get(server.url + "/v1/responses/resp-nope").status_code == 404


def weather_agent(agents, server, seen: list, **agent_kw):
    """An Agents SDK agent on OpenAIResponsesModel whose forced tool call lands in `seen`."""
    from openai.types.shared import Reasoning
    agents.set_tracing_disabled(True)

    @agents.function_tool      # bounded arguments: random weights could write an endless integer
    def get_weather(city: Literal["paris", "rome"], metric: bool) -> str:
        """Weather in a city."""
        seen.append((city, metric))
        return "sunny"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                        model=agents.OpenAIResponsesModel(model=server.model, openai_client=client),
                        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                            max_tokens=300, parallel_tool_calls=False,
                                                            # thinking off: random weights think on
                                                            reasoning=Reasoning(effort="minimal")),
                        **agent_kw)


@needs_xgrammar
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
def test_agents_sdk_tool_agent(server, streamed):
    """The Agents SDK's default model (OpenAIResponsesModel, /v1/responses) runs a tool agent:
    the forced call reaches the tool with schema-valid arguments, its output goes back as a
    function_call_output item, and the run ends in a final text answer."""
    agents = pytest.importorskip("agents")
    import asyncio
    seen = []
    agent = weather_agent(agents, server, seen, tool_use_behavior="stop_on_first_tool")

    async def go():
        if not streamed:
            return await agents.Runner.run(agent, "Weather for two days?", max_turns=2)
        run = agents.Runner.run_streamed(agent, "Weather for two days?", max_turns=2)
        kinds = [e.type async for e in run.stream_events()]
        assert "raw_response_event" in kinds
        return run
    result = asyncio.run(go())
    assert len(seen) == 1 and seen[0][0] in ("paris", "rome") and type(seen[0][1]) is bool
    assert result.final_output == "sunny"
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert len(calls) == 1 and json.loads(calls[0].raw_item.arguments)["city"] == seen[0][0]


@needs_xgrammar
@pytest.mark.parametrize("chained", [False, True], ids=["items", "previous_response_id"])
def test_agents_sdk_tool_loop(server, chained):
    """The SDK's tool loop for 2 turns, each a forced call answered by the tool: the history goes
    back as input items (function_call, function_call_output), or (chained) as
    previous_response_id plus the new function_call_output only. Random weights would not end a
    free-text answer within max_tokens, so the run ends at max_turns (2: the second call carries the
    first's call and output)."""
    agents = pytest.importorskip("agents")
    import asyncio
    seen = []
    agent = weather_agent(agents, server, seen, reset_tool_choice=False)
    with pytest.raises(agents.exceptions.MaxTurnsExceeded):
        asyncio.run(agents.Runner.run(agent, "Weather?", max_turns=2, auto_previous_response_id=chained))
    assert len(seen) == 2 and all(c in ("paris", "rome") and type(m) is bool for c, m in seen)


def test_stored_response_survives_eviction(ckpt):
    """A stored response's capsule is pinned: after enough other traffic to evict an unpinned
    one (the control: a chat prompt's capsule is gone), its continuation still reuses the whole
    history; once deleted, it is evictable again. Past --response-retain-mb: a 507."""
    s = Server(ckpt("qwen3", "tiny", chat=True), "--max-sessions", "1", "--max-seq-len", "1024",
               "--capsule-budget-mb", "0.5", "--response-retain-mb", "0.05")
    try:
        c = s.client()
        kept = c.responses.create(model=s.model, input="keep me " * 20, max_output_tokens=4, temperature=0)
        history = kept.usage.input_tokens + kept.usage.output_tokens
        full = s.post("/v1/responses", {"input": "x", "max_output_tokens": 1})    # ~100 KB pinned: past 50 KB
        assert full.status_code == 507 and full.json()["error"]["param"] == "store", full.text
        control = [{"role": "user", "content": "control " * 20}]
        s.post("/v1/chat/completions", {"messages": control, "max_tokens": 1, "temperature": 0})
        for i in range(12):         # other traffic, none of it stored
            c.responses.create(model=s.model, input=f"{i} other traffic " * 20, max_output_tokens=1,
                               temperature=0, store=False)
        again = s.post("/v1/chat/completions", {"messages": control, "max_tokens": 1, "temperature": 0}).json()
        u = again["usage"]      # only the template's shared head is left of the control
        assert u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"] // 4, "no eviction pressure"
        nxt = c.responses.create(model=s.model, previous_response_id=kept.id, input="go on",
                                 max_output_tokens=1, temperature=0, store=False)
        assert nxt.usage.input_tokens_details.cached_tokens >= history
        c.responses.delete(kept.id)       # unpinned: room for a stored response again
        assert s.post("/v1/responses", {"input": "x", "max_output_tokens": 1}).status_code == 200
    finally:
        s.stop()
