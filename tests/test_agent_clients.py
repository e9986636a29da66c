"""Agent frameworks against `flashrt serve`: the request bodies the real clients send (tools,
tool_choice, parallel_tool_calls, response_format, tool results, streamed calls) answered 200
with results that the clients themselves parse and validate. One real uvicorn server on
loopback over a tiny random-weight Qwen3.5 checkpoint with its released template: the text is
meaningless, so a call must happen only where tool_choice forces one, and a grammar makes
every call and every structured output schema-valid (what each test checks). Each framework
is skipped without its package (the `agent-clients` extra).

Random weights: greedy, thinking off (chat_template_kwargs; it would think until max_tokens),
blanks banned (the grammar allows padding a random model loves) so each reply has a bounded
length; `<|im_end|>` favoured so an unforced reply ends early.
`run.sh setup` installs the extra."""
from __future__ import annotations

import asyncio
import importlib.util
import json
from typing import Annotated, Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from serve_util import Server  # noqa: E402


def needs(*modules):
    """Skipped (before the server starts) without one of modules; xgrammar: every test here
    forces a call or a schema."""
    missing = [m for m in ("xgrammar", *modules) if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (the agent-clients extra)")


# make_checkpoint's chat tokenizer is byte-level (a blank is its byte's id) with the template's
# special tokens from 256: <|im_end|> 258, <tool_call> 270, </tool_call> 271
BIAS = {**{str(b): -100 for b in b" \n\r\t"}, "258": 5}
# where exactly one call is forced (parallel_tool_calls false): its tags as the template's one
# token each, not spelled out in bytes (with parallel calls, free text may follow the first call,
# and a random model so biased writes tags until max_tokens)
CALL_BIAS = {**BIAS, "270": 100, "271": 100}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CALL_TOKENS = 120       # a Qwen3.5 XML call of one or two short parameters, with room


class Pick(BaseModel):
    """A pick."""
    color: Literal["red", "green", "blue"]
    n: int = Field(ge=0, le=9)


class Loose(BaseModel):
    """Any JSON object (json_mode has no schema: random weights write any object)."""
    model_config = ConfigDict(extra="allow")


Digit = Annotated[int, Field(ge=0, le=9)]


@pytest.fixture(scope="module")
def server(ckpt):
    # one engine thread: a tiny model gains nothing from two, and they stall when the cores are shared
    s = Server(ckpt("qwen3_5", "tiny", chat=True), "--max-sessions", "2", "--max-seq-len", "2048",
               "--threads", "1")
    yield s
    s.stop()


# ---- langchain-openai ------------------------------------------------------------------------------
def chat_openai(server, max_tokens=CALL_TOKENS, logit_bias=BIAS):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=server.model, base_url=server.url + "/v1", api_key="none", max_retries=0,
                      temperature=0, max_tokens=max_tokens, logit_bias=logit_bias, extra_body=NO_THINK)


def lc_add(ran: list):
    from langchain_core.tools import tool

    @tool
    def add(a: Digit) -> str:
        """Add a digit."""
        ran.append(a)
        return f"got {a}"
    return add


@needs("langchain_openai")
def test_langchain_bind_tools_auto(server):
    """tool_choice auto on random weights: a reply (text, or calls the schema accepts)."""
    add = lc_add([])
    m = chat_openai(server, max_tokens=8, logit_bias={}).bind_tools([add]).invoke("What is 2 + 3?")
    assert m.response_metadata["finish_reason"] in ("stop", "length", "tool_calls"), m.response_metadata
    assert isinstance(m.content, str) and "<tool_call>" not in m.content
    for call in m.tool_calls:
        assert call["name"] == "add" and call["id"].startswith("call_")
        add.args_schema.model_validate(call["args"])
    assert m.usage_metadata["output_tokens"] <= 8


@needs("langchain_openai")
def test_langchain_bind_tools_named_no_parallel_streamed(server):
    """bind_tools(tool_choice="add", parallel_tool_calls=False), streamed: the chunks fold (as
    LangChain folds them) to exactly one call of add with arguments its schema accepts."""
    add = lc_add([])
    llm = chat_openai(server, logit_bias=CALL_BIAS).bind_tools([add], tool_choice="add", parallel_tool_calls=False)
    chunks = list(llm.stream("What is 2 + 3?"))
    m = chunks[0]
    for c in chunks[1:]:
        m = m + c
    assert len(chunks) > 3 and m.response_metadata["finish_reason"] == "tool_calls", m.response_metadata
    assert not m.invalid_tool_calls and len(m.tool_calls) == 1, (m.tool_calls, m.invalid_tool_calls)
    call = m.tool_calls[0]
    assert call["name"] == "add" and call["id"].startswith("call_")
    add.args_schema.model_validate(call["args"])
    assert set(call["args"]) == {"a"} and m.content == ""


@needs("langchain_openai")
@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_langchain_structured_output(server, method):
    """with_structured_output's three methods (response_format json_schema strict, json_object,
    a named tool): the client's own parser returns the model, no parsing error."""
    schema = Loose if method == "json_mode" else Pick
    # json_object has no schema: '"' and '}' favoured so a random object closes soon
    closing = {str(ord(c)): 3 for c in '"}'}
    bias = {"json_mode": {**BIAS, **closing}, "function_calling": CALL_BIAS}.get(method, BIAS)
    llm = chat_openai(server, logit_bias=bias).with_structured_output(schema, method=method, include_raw=True)
    out = llm.invoke("Pick a color and a digit.")
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], schema)
    raw = out["raw"]
    if method == "function_calling":
        assert [c["name"] for c in raw.tool_calls] == ["Pick"], raw.tool_calls
        assert raw.response_metadata["finish_reason"] == "tool_calls"
        assert Pick.model_validate(raw.tool_calls[0]["args"]) == out["parsed"]
    else:
        assert raw.response_metadata["finish_reason"] == "stop" and not raw.tool_calls
        assert schema.model_validate_json(raw.content) == out["parsed"]
        assert isinstance(json.loads(raw.content), dict)


# ---- LangGraph --------------------------------------------------------------------------------------
@needs("langchain_openai", "langgraph")
def test_langgraph_react_loop(server):
    """create_react_agent with a dynamic model: tool_choice required on the first step, none once
    a tool result came back, so the graph runs model -> tool -> model -> end. The tool ran with
    arguments its schema accepts; the second step's prompt reused the first's (cached_tokens)."""
    import warnings

    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langgraph.prebuilt import create_react_agent

    ran = []
    add = lc_add(ran)
    llm = chat_openai(server)

    def model(state, runtime):
        after_tool = isinstance(state["messages"][-1], ToolMessage)
        return llm.bind_tools([add], tool_choice="none" if after_tool else "required", parallel_tool_calls=False)

    with warnings.catch_warnings():     # LangGraph 1.x points to langchain.agents (another package)
        warnings.simplefilter("ignore", DeprecationWarning)
        agent = create_react_agent(model, [add])
    out = agent.invoke({"messages": [HumanMessage("What is 2 + 3?")]}, {"recursion_limit": 6})
    msgs = out["messages"]
    assert [type(m) for m in msgs] == [HumanMessage, AIMessage, ToolMessage, AIMessage], msgs
    first, result, last = msgs[1], msgs[2], msgs[3]
    assert len(first.tool_calls) == 1 and first.tool_calls[0]["name"] == "add"
    assert first.response_metadata["finish_reason"] == "tool_calls"
    assert len(ran) == 1 and 0 <= ran[0] <= 9 and result.status == "success"
    assert result.tool_call_id == first.tool_calls[0]["id"] and result.content == f"got {ran[0]}"
    assert not last.tool_calls and last.response_metadata["finish_reason"] in ("stop", "length")
    # Qwen3.5's recurrent state: reuse from the step's own prompt on (the call the template
    # renders back differs from the one random weights wrote, so the prefix ends there)
    assert last.usage_metadata["input_token_details"]["cache_read"] >= first.usage_metadata["input_tokens"], \
        (first.usage_metadata, last.usage_metadata)


# ---- OpenAI Agents SDK -----------------------------------------------------------------------------
def agents_model(server):
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)          # no trace export (it would call OpenAI's API)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return OpenAIChatCompletionsModel(model=server.model, openai_client=client)


def agents_settings(**kw):
    from agents import ModelSettings
    return ModelSettings(temperature=0, max_tokens=CALL_TOKENS, extra_body={**NO_THINK, "logit_bias": BIAS}, **kw)


@needs("agents")
def test_agents_sdk_tool_agent_streamed(server):
    """A tool agent with ModelSettings(tool_choice="required") (strict tools), run streamed: the
    tool runs once with a valid digit (the SDK validates against the strict schema first), then
    the SDK's reset tool_choice lets the model answer, which ends the run."""
    from agents import Agent, Runner, function_tool

    ran = []

    @function_tool
    def add(a: Digit) -> str:
        """Add a digit."""
        ran.append(a)
        return f"got {a}"

    agent = Agent(name="adder", instructions="Use the tool.", tools=[add], model=agents_model(server),
                  model_settings=agents_settings(tool_choice="required"))

    async def run():
        r = Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
        kinds = [e.item.type async for e in r.stream_events() if e.type == "run_item_stream_event"]
        return r, kinds
    r, kinds = asyncio.run(run())
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert len(ran) == 1 and 0 <= ran[0] <= 9
    assert r.new_items[1].output == f"got {ran[0]}" and isinstance(r.final_output, str)


@needs("agents")
def test_agents_sdk_output_type(server):
    """output_type=Pick: response_format json_schema (strict); the SDK validates the reply."""
    from agents import Agent, Runner
    agent = Agent(name="picker", instructions="Pick.", output_type=Pick, model=agents_model(server),
                  model_settings=agents_settings())
    r = asyncio.run(Runner.run(agent, "Pick a color and a digit.", max_turns=1))
    assert isinstance(r.final_output, Pick), r.final_output
    assert r.raw_responses[0].usage.output_tokens < CALL_TOKENS       # it ended, not cut


# ---- pydantic-ai ------------------------------------------------------------------------------------
@needs("pydantic_ai")
@pytest.mark.parametrize("native", [False, True], ids=["tool-output", "native-output"])
def test_pydantic_ai_output(server, native):
    """The default structured output (a final_result tool under tool_choice required) and
    NativeOutput (response_format json_schema): the agent's own validation gives a Pick, with
    no retry (retries=0: an invalid reply would raise)."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.messages import TextPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="none"))
    settings = dict(max_tokens=CALL_TOKENS, temperature=0, logit_bias=BIAS, extra_body=NO_THINK)
    agent = Agent(model, output_type=NativeOutput(Pick) if native else Pick, model_settings=settings,
                  retries=0)
    r = agent.run_sync("Pick a color and a digit.")
    assert isinstance(r.output, Pick)
    parts = r.all_messages()[1].parts
    assert [type(p) for p in parts] == ([TextPart] if native else [ToolCallPart]), parts
    if native:
        assert Pick.model_validate_json(parts[0].content) == r.output
    else:
        assert parts[0].tool_call_id.startswith("call_")
        assert Pick.model_validate(parts[0].args_as_dict()) == r.output


# ---- litellm ----------------------------------------------------------------------------------------
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add a digit.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"], "additionalProperties": False}}}


@needs("litellm")
@pytest.mark.filterwarnings("ignore::UserWarning")     # pydantic on litellm's own TypedDicts, at import
@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm(server, provider, monkeypatch):
    """completion(model="<provider>/<served name>", api_base=...) with tools (tool_choice
    required) and with response_format=Pick (litellm turns it into json_schema)."""
    # litellm fetches a price list from the internet at import unless told to use its own copy
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"{provider}/{server.model}", api_base=server.url + "/v1", api_key="none", temperature=0,
              max_tokens=CALL_TOKENS, logit_bias=BIAS, extra_body=NO_THINK,
              messages=[{"role": "user", "content": "What is 2 + 3?"}])
    c = litellm.completion(tools=[ADD], tool_choice="required", **kw).choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0]
    assert call.function.name == "add" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"a"} and type(args["a"]) is int and 0 <= args["a"] <= 9, args
    c = litellm.completion(response_format=Pick, **kw).choices[0]
    assert c.finish_reason == "stop", c
    Pick.model_validate_json(c.message.content)
