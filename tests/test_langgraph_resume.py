"""LangGraph checkpoints that keep their model state (flashrt.integrations.langgraph) against a real
`flashrt serve` over a tiny random-weight Qwen3.5 with its released template:

- a ReAct agent on RetainingSaver(InMemorySaver()): replaying its second model call from a
  checkpoint reuses about the whole prompt, and an update_state fork that edits the tool result
  prefills only the edited tail, both after enough other traffic to evict every unretained capsule;
  deleting the thread releases the references (the same traffic then evicts them);
- a node that calls the model (sampled) and then interrupt()s: resumed with Command(resume=...),
  its call returns the identical completion and the server ran the model once; a fork of the
  thread samples afresh.

The `agent-clients` extra (langchain-openai, langgraph); xgrammar forces the tool call."""
from __future__ import annotations

import warnings
from typing import Annotated, TypedDict

import httpx
import pytest

pytest.importorskip("fastapi")
for _m in ("langgraph", "langchain_openai", "xgrammar"):
    pytest.importorskip(_m, reason="the agent-clients extra")

from langchain_core.messages import AnyMessage  # noqa: E402
from langgraph.graph.message import add_messages  # noqa: E402
from serve_util import Server  # noqa: E402
from test_agent_clients import chat_openai, lc_add  # noqa: E402

from flashrt.integrations.langgraph import RetainingSaver, idempotent, response_ids  # noqa: E402

class Draft(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    approved: bool


TRAFFIC = 12          # distinct conversations of ~650 tokens: several times the 2 MB capsule budget


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt("qwen3_5", "tiny", chat=True), "--max-sessions", "2", "--max-seq-len", "2048",
               "--threads", "1", "--capsule-budget-mb", "2")
    yield s
    s.stop()


@pytest.fixture
def jobs_run():
    """The model jobs the server ran for this caller (GET /v1/flashrt/stats)."""
    return lambda server: httpx.get(server.url + "/v1/flashrt/stats").json()["jobs"]


def traffic(server, tag: str) -> None:
    """Conversations sharing no prefix with the agent's (another system prompt) whose capsules push
    every unpinned one out of a 2 MB store: checked on a control conversation sent first."""
    def chat(system: str, user: str) -> dict:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": server.model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    chat(f"Control {tag}: " + "c" * 300, "control")
    for i in range(TRAFFIC):
        chat(f"Traffic {tag} {i}: " + "x" * 600, f"unrelated {i}")
    u = chat(f"Control {tag}: " + "c" * 300, "control")
    assert u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"] // 4, ("no eviction pressure", u)


def cache_read(m) -> int:
    return m.usage_metadata["input_token_details"]["cache_read"]


def react_agent(server, saver):
    from langchain_core.messages import ToolMessage
    from langgraph.prebuilt import create_react_agent
    add = lc_add([])
    llm = chat_openai(server)

    def model(state, runtime):
        after_tool = isinstance(state["messages"][-1], ToolMessage)
        return llm.bind_tools([add], tool_choice="none" if after_tool else "required", parallel_tool_calls=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_react_agent(model, [add], checkpointer=saver)


def before_second_call(agent, config):
    """The checkpoint whose next step is the model call after the tool ran."""
    from langchain_core.messages import ToolMessage
    for snap in agent.get_state_history(config):
        if snap.next == ("agent",) and isinstance(snap.values["messages"][-1], ToolMessage):
            return snap
    raise AssertionError("no checkpoint before the second model call")


def test_contract_prefix_continuation_langgraph_replay_and_fork_after_eviction(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver
    saver = RetainingSaver(InMemorySaver(), server.url + "/v1")
    agent = react_agent(server, saver)
    config = {"configurable": {"thread_id": "react-1"}, "recursion_limit": 6}
    out = agent.invoke({"messages": [HumanMessage("What is 2 + 3?")]}, config)
    first, tool, last = out["messages"][1:]
    ids = response_ids({"channel_values": out})
    assert ids == [first.response_metadata["id"], last.response_metadata["id"]]
    assert saver.refs.unknown == []

    traffic(server, "a")                                    # every unretained capsule is gone
    snap = before_second_call(agent, config)
    replay = agent.invoke(None, snap.config)["messages"][-1]
    assert replay.response_metadata["id"] != last.response_metadata["id"]      # it ran again
    prompt = last.usage_metadata["input_tokens"]
    assert replay.usage_metadata["input_tokens"] == prompt
    assert cache_read(replay) >= prompt - 1, (replay.usage_metadata, prompt)   # about the whole prompt

    traffic(server, "b")
    edited = ToolMessage("got 7", id=tool.id, tool_call_id=tool.tool_call_id)  # replaces it by id
    fork = agent.update_state(snap.config, {"messages": [edited]}, as_node="tools")
    forked = agent.invoke(None, fork)["messages"][-1]
    # the shared prefix runs to the first call's prompt end at least (random weights write the call
    # unlike the template renders it); what is new is the call, the edited result, the prompt tail
    assert cache_read(forked) >= first.usage_metadata["input_tokens"], forked.usage_metadata
    assert forked.usage_metadata["input_tokens"] - cache_read(forked) < \
        forked.usage_metadata["input_tokens"] - first.usage_metadata["input_tokens"] + 64

    # the second call's request again, outside the graph, reuses the retained state; after
    # delete_thread the same traffic evicts it
    again = chat_openai(server).bind_tools([lc_add([])], tool_choice="none", parallel_tool_calls=False)
    traffic(server, "c")
    warm = again.invoke(snap.values["messages"])
    assert cache_read(warm) >= prompt - 1, warm.usage_metadata
    saver.delete_thread("react-1")
    assert saver.refs.unknown == []
    traffic(server, "d")
    cold = again.invoke(snap.values["messages"])
    assert cache_read(cold) < prompt // 2, cold.usage_metadata


def test_contract_exactly_once_langgraph_interrupt_resume_runs_the_model_once(server, jobs_run):
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Command, interrupt

    # sampled, unseeded: two runs of the model would almost surely differ
    llm = idempotent(chat_openai(server, max_tokens=12).bind(temperature=1.0))
    drafts = []

    def draft(state):
        m = llm.invoke(state["messages"])
        drafts.append(m)
        ok = interrupt({"draft": m.content})
        return {"messages": [m], "approved": ok}

    g = StateGraph(Draft)
    g.add_node("draft", draft)
    g.add_edge(START, "draft")
    g.add_edge("draft", END)
    saver = RetainingSaver(InMemorySaver(), server.url + "/v1")
    graph = g.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "approve-1"}}

    n0 = jobs_run(server)
    graph.invoke({"messages": [HumanMessage("Draft a reply.")]}, config)
    n1 = jobs_run(server)
    out = graph.invoke(Command(resume=True), config)
    n2 = jobs_run(server)
    assert len(drafts) == 2 and out["approved"] is True
    a, b = drafts
    assert b.response_metadata["id"] == a.response_metadata["id"] and b.content == a.content
    assert b.tool_calls == a.tool_calls and b.usage_metadata == a.usage_metadata
    assert n1 - n0 == 1 and n2 == n1, (n0, n1, n2)         # the resume did not run the model
    assert out["messages"][-1].response_metadata["id"] == a.response_metadata["id"]

    # a fork from the checkpoint before the node: new task ids, a fresh sample
    start = [s for s in graph.get_state_history(config) if s.next == ("draft",)][-1]
    graph.invoke(None, start.config)
    assert drafts[-1].response_metadata["id"] != a.response_metadata["id"]
    assert jobs_run(server) == n2 + 1
    saver.delete_thread("approve-1")


def test_copy_prune_and_runs_follow_the_references(server):
    """copy_thread takes the copies' references and prune releases the pruned checkpoints' own,
    with a saver that implements them (InMemorySaver does not); counted through the server's
    retain / release answers."""
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver

    class Saver(InMemorySaver):
        def copy_thread(self, source, target):
            for ns, cps in list(self.storage[source].items()):
                self.storage[target][ns] = dict(cps)
            for (t, ns, cid), w in list(self.writes.items()):
                if t == source:
                    self.writes[(target, ns, cid)] = dict(w)

        def prune(self, thread_ids, *, strategy="keep_latest"):
            for t in thread_ids:
                for ns, cps in self.storage[t].items():
                    keep = max(cps) if strategy == "keep_latest" else None
                    for cid in [c for c in cps if c != keep]:
                        del cps[cid]

    saver = RetainingSaver(Saver(), server.url + "/v1")
    agent = react_agent(server, saver)
    agent.invoke({"messages": [HumanMessage("What is 4 + 1?")]},
                 {"configurable": {"thread_id": "p-1"}, "recursion_limit": 6})
    held = saver._thread("p-1")
    taken = sum(len(v) for v in held.values())
    assert taken >= 3           # the checkpoints after each model call and the tool hold the ids
    rid = next(i for v in held.values() for i in v)

    def count() -> int:         # the server's references: one more, read, one less
        n = httpx.post(server.url + "/v1/flashrt/retain", json={"ids": [rid]}).json()["retained"][rid]
        httpx.post(server.url + "/v1/flashrt/release", json={"ids": [rid]}).raise_for_status()
        return n - 1
    base = count()
    per_thread = sum(v.count(rid) for v in held.values())
    assert base == per_thread
    saver.copy_thread("p-1", "p-2")
    assert count() == 2 * per_thread
    latest = max(held)
    saver.prune(["p-1"])
    assert count() == per_thread + held[latest].count(rid)
    saver.delete_thread("p-1")
    saver.delete_thread("p-2")
    assert count() == 0
