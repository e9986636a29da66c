"""bench/agent.py's LangGraph part (issue 34): a time-travel replay and an update_state fork of a
ReAct agent's last model step, after store pressure, with flashrt's RetainingSaver against a plain
InMemorySaver; the reference is a warm turn on the same tokens.

The agent: LangGraph's create_react_agent over ChatOpenAI pointed at `flashrt serve` (the bench's
chat checkpoint, tools, system prompt, question and biases), a dynamic model (as
tests/test_langgraph_resume.py): tool_choice "required" with the call bias until --resume-steps - 1
tools ran, then "none"; greedy. The same loop runs twice, once per saver, each thread in a cache
namespace of its own (cache_salt), so the two share no capsule; RetainingSaver retains the
response ids of each checkpoint's AI messages (POST /v1/flashrt/retain), the plain saver nothing.

The server: --max-sessions 1 and a capsule budget (--resume-budget-mb; by default about three
times what the loop retains, an estimate from the model's capsule bytes). Each round first applies store pressure:
conversations sharing no prefix with the agent's, as many as twice the budget's worth of capsules
(the count is computed from the model's capsule bytes: fixed state + rows per token, from the
model code), checked by a control conversation sent before them and again after, whose cached
tokens must drop below a quarter of its prompt. Then the cases, their order reversed every other
round, each after a one-token request in another namespace (the engine's session resets, so no
case reuses the live session of the one before):
  replay   the checkpoint before the last model call, replayed: graph.invoke(None, snapshot.config)
           re-sends the identical request. Timed: that request (the body the loop's ChatOpenAI
           sent, captured by an httpx hook) with stream true, by httpx, TTFT = first chunk
  fork     update_state on that checkpoint replacing the last tool result (as_node "tools"): the
           next model step's request, the same body with the edited tool message
  warm     the replay's request in a fresh namespace, sent twice (a reset between): the second,
           timed, restores the capsule the first left, as the replay restores the retained one.
           The acceptance's reference: "a warm turn's TTFT on the same tokens"
After the timed rounds, one more round of pressure, then the real graph replays and forks (both
savers): their captured request bodies must equal the timed ones and their cached tokens agree.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math

from bench import common as C

ACCEPT_REPLAY = 1.2                  # the line: replay TTFT <= 1.2x a warm turn's
MB = 1 << 20
TRAFFIC_TOKENS = 300                 # prompt tokens of one pressure conversation (about)
SAVERS = ("retaining", "plain")
CASES = ("replay", "fork")
EDIT = " (corrected: the tool was run again)"


def add_args(p) -> None:
    p.add_argument("--resume-steps", type=int, default=3,
                   help="model calls of the LangGraph loop (the last one text; default 3)")
    p.add_argument("--resume-budget-mb", type=float, default=None,
                   help="--capsule-budget-mb of its server (default: about 3x what the loop retains)")
    p.add_argument("--resume-repeats", type=int, default=None,
                   help="timed rounds of the replay and fork cases (default --repeats)")
    p.add_argument("--no-resume", action="store_true", help="skip the LangGraph replay and fork cases")


def capsule_cost(ckpt, dtype: str) -> tuple:
    """(fixed bytes, bytes per token) of one stored capsule, from the model code (meta device)."""
    from bench.state_sizes import capsule_cost as cost
    return cost(json.loads((ckpt / "config.json").read_text()), dtype)


def lc_tools():
    from langchain_core.tools import tool

    from bench.agent_tools import run_tool

    @tool
    def search(page: int) -> str:
        """Search the user's notes; returns one page of hits"""
        return run_tool("search", {"page": page})

    @tool
    def weather(days: int) -> str:
        """The forecast at the user's destination"""
        return run_tool("weather", {"days": days})

    @tool
    def clock() -> str:
        """The current date and time"""
        return run_tool("clock", {})
    return [search, weather, clock]


class Agent:
    """One saver's ReAct agent on the server, its model calls' request bodies recorded."""

    def __init__(self, srv, kind: str, a, biases):
        import httpx
        from langchain_core.messages import ToolMessage
        from langchain_openai import ChatOpenAI
        from langgraph.checkpoint.memory import InMemorySaver
        from langgraph.prebuilt import create_react_agent

        from bench.agent_tools import TOOLS
        from flashrt.integrations.langgraph import RetainingSaver
        self.kind, self.bodies = kind, []

        def record(request):
            if request.url.path.endswith("/chat/completions"):
                self.bodies.append(json.loads(request.content))
        self.http = httpx.Client(timeout=1800, event_hooks={"request": [record]})
        llm = ChatOpenAI(model=srv.model, base_url=srv.url + "/v1", api_key="none", max_retries=0, temperature=0,
                         http_client=self.http, extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                            "cache_salt": f"lg-{kind}"})

        def model(state, runtime):
            forced = sum(isinstance(m, ToolMessage) for m in state["messages"]) < a.resume_steps - 1
            kw = {"max_tokens": a.call_tokens, "logit_bias": biases["call"]} if forced else \
                {"max_tokens": a.answer_tokens}
            return llm.bind_tools(TOOLS, tool_choice="required" if forced else "none",
                                  parallel_tool_calls=False, **kw)
        self.saver = RetainingSaver(InMemorySaver(), srv.url + "/v1") if kind == "retaining" else InMemorySaver()
        self.graph = create_react_agent(model, lc_tools(), checkpointer=self.saver)
        self.config = {"configurable": {"thread_id": kind}, "recursion_limit": 4 * a.resume_steps}

    def run(self, system: str, question: str) -> dict:
        """The loop; the checkpoint before its last model call, its update_state fork, and the
        two requests the bench times (the replay's and the fork's, streamed)."""
        from langchain_core.messages import AIMessage, ToolMessage
        out = self.graph.invoke({"messages": [("system", system), ("user", question)]}, self.config)
        ais = [m for m in out["messages"] if isinstance(m, AIMessage)]
        if len(ais) != len(self.bodies) or [bool(m.tool_calls) for m in ais] != \
                [True] * (len(ais) - 1) + [False]:
            raise RuntimeError(f"{self.kind}: expected {len(ais) - 1} tool calls then text, got "
                               f"{[m.tool_calls for m in ais]}")
        self.snap = next(s for s in self.graph.get_state_history(self.config)
                         if s.next == ("agent",) and isinstance(s.values["messages"][-1], ToolMessage))
        tool = self.snap.values["messages"][-1]
        edited = ToolMessage(tool.content + EDIT, id=tool.id, tool_call_id=tool.tool_call_id)
        self.fork = self.graph.update_state(self.snap.config, {"messages": [edited]}, as_node="tools")
        replay = {**self.bodies[-1], "stream": True, "stream_options": {"include_usage": True}}
        fork = copy.deepcopy(replay)
        if fork["messages"][-1].get("role") != "tool":
            raise RuntimeError(f"{self.kind}: the last model call's request does not end with the tool result")
        fork["messages"][-1]["content"] += EDIT
        self.requests = {"replay": replay, "fork": fork}
        return {"calls": [m.tool_calls[0]["name"] + json.dumps(m.tool_calls[0]["args"]) for m in ais[:-1]],
                "answer": ais[-1].content, "ids": [m.response_metadata.get("id") for m in ais],
                "prompt_tokens": [m.usage_metadata["input_tokens"] for m in ais],
                "cached": [m.usage_metadata["input_token_details"].get("cache_read", 0) for m in ais]}

    def graph_call(self, case: str) -> dict:
        """The real graph replay or fork: its model call's usage and whether its request was
        the one the bench timed."""
        n = len(self.bodies)
        msg = self.graph.invoke(None, self.snap.config if case == "replay" else self.fork)["messages"][-1]
        plain = lambda b: {k: v for k, v in b.items() if k not in ("stream", "stream_options")}  # noqa: E731
        return {"prompt_tokens": msg.usage_metadata["input_tokens"],
                "cached": msg.usage_metadata["input_token_details"].get("cache_read", 0),
                "same_request": len(self.bodies) == n + 1 and plain(self.bodies[-1]) == plain(self.requests[case])}


def default_budget(a, fixed: int, per_token: int, first_prompt: int) -> float:
    """Three times what the loop retains: a capsule at each prompt end and turn end (fixed state
    each; rows shared as deltas), rows up to the last prompt."""
    rows = first_prompt + a.resume_steps * (a.call_tokens + 160)
    return math.ceil(3 * (2 * a.resume_steps * fixed + rows * per_token) / MB * 2) / 2


def measure(ckpt, tok, a, biases, first_prompt: int) -> dict:
    """The LangGraph cases; {"measured": False, "why"} when skipped."""
    if a.no_resume:
        return {"measured": False, "why": "skipped (--no-resume)"}
    missing = [m for m in ("langgraph", "langchain_openai", "xgrammar") if importlib.util.find_spec(m) is None]
    if missing:
        return {"measured": False, "why": f"not installed: {', '.join(missing)} (the agent-clients extra)"}
    import httpx

    from bench.agent_tools import QUESTION, SYSTEM, cached_of, stream
    from bench.serve import start_flashrt
    fixed, per_token = capsule_cost(ckpt, a.dtype)
    budget = a.resume_budget_mb or default_budget(a, fixed, per_token, first_prompt)
    traffic_n = math.ceil(2 * budget * MB / (2 * fixed + TRAFFIC_TOKENS * per_token))
    srv = start_flashrt(ckpt, a, budget, "--response-retain-mb", str(budget))
    client = httpx.Client(timeout=1800)
    url = srv.url + "/v1/chat/completions"

    def chat(system: str, user: str, salt: str = "pressure") -> dict:
        r = client.post(url, json={"model": srv.model, "max_tokens": 1, "temperature": 0, "cache_salt": salt,
                                   "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": user}]})
        r.raise_for_status()
        return r.json()["usage"]

    def pressure(tag: str) -> dict:
        control = (f"Control {tag}: " + "c" * TRAFFIC_TOKENS, "control")
        chat(*control)                    # leaves its capsules; the next one reuses them
        before = chat(*control)
        for i in range(traffic_n):
            chat(f"Traffic {tag} {i}: " + "x" * TRAFFIC_TOKENS, f"unrelated {i}")
        after = chat(*control)
        return {"control_prompt": after["prompt_tokens"], "cached_before": cached_of({"usage": before}),
                "cached_after": cached_of({"usage": after}),
                "evicted": cached_of({"usage": after}) < after["prompt_tokens"] // 4}

    def reset():                      # the engine's one session leaves this namespace's history
        client.post(srv.url + "/v1/completions", json={"model": srv.model, "prompt": "reset", "max_tokens": 1,
                                                       "cache_salt": "scratch"}).raise_for_status()

    def timed(body: dict) -> dict:
        reset()
        r = stream(client, url, body)
        return {"ttft": r["ttft"], "prompt_tokens": r["usage"]["prompt_tokens"], "cached": cached_of(r)}

    try:
        agents = {k: Agent(srv, k, a, biases) for k in SAVERS}
        loops = {k: ag.run(SYSTEM, QUESTION) for k, ag in agents.items()}
        cases = {f"{c} ({k} saver)": (lambda c=c, k=k: timed(agents[k].requests[c])) for c in CASES for k in SAVERS}

        def warm(rep):
            body = {**agents["retaining"].requests["replay"], "cache_salt": f"warm-{rep}"}
            reset()
            stream(client, url, body)             # untimed: leaves the prompt's capsule
            return timed(body)
        names = list(cases) + ["warm turn"]
        runs, rounds = {k: [] for k in names}, []
        for r in C.progress(range(a.warmup + (a.resume_repeats or a.repeats)), desc="LangGraph replay / fork"):
            rounds.append(pressure(f"round {r}"))
            for name in names if r % 2 == 0 else names[::-1]:
                got = warm(r) if name == "warm turn" else cases[name]()
                if r >= a.warmup:
                    runs[name].append(got)
        final = pressure("graph")
        graph = {}
        for c in CASES:
            for k in SAVERS:
                reset()
                graph[f"{c} ({k} saver)"] = agents[k].graph_call(c)
        for ag in agents.values():
            ag.http.close()
    finally:
        client.close()
        srv.stop()
    rows = {}
    for name, xs in runs.items():
        ttft = C.Stats(samples=[x["ttft"] for x in xs])
        rows[name] = {"prompt_tokens": xs[0]["prompt_tokens"], "cached": xs[0]["cached"],
                      "new": xs[0]["prompt_tokens"] - xs[0]["cached"], "ttft_ms": ttft.median * 1e3,
                      "min_ms": ttft.min * 1e3, "max_ms": ttft.max * 1e3, "samples": len(xs)}
    for r in rows.values():
        r["vs_warm"] = r["ttft_ms"] / rows["warm turn"]["ttft_ms"]
    res = {"measured": True, "why": None, "budget_mb": budget, "traffic": traffic_n,
           "traffic_tokens": TRAFFIC_TOKENS, "capsule_fixed_bytes": fixed, "capsule_token_bytes": per_token,
           "steps": a.resume_steps, "loops": loops, "rows": rows, "runs": runs, "pressure": rounds + [final],
           "graph": graph}
    res["checks"] = checks(res)
    return res


def checks(res) -> dict:
    runs, loops, graph = res["runs"], res["loops"], res["graph"]
    prev_prompt = loops["retaining"]["prompt_tokens"][-2]
    small = lambda x: x["cached"] < x["prompt_tokens"] // 4             # noqa: E731
    return {
        "eviction_verified": all(p["evicted"] and p["cached_before"] >= p["control_prompt"] - 1
                                 for p in res["pressure"]),
        "loops_identical": {k: v for k, v in loops["retaining"].items() if k != "ids"}
        == {k: v for k, v in loops["plain"].items() if k != "ids"},
        "replay_retained_whole_prompt": all(x["cached"] >= x["prompt_tokens"] - 1
                                            for x in runs["replay (retaining saver)"]),
        "warm_same_tokens": all(w["prompt_tokens"] == x["prompt_tokens"] and w["cached"] == x["cached"]
                                for w, x in zip(runs["warm turn"], runs["replay (retaining saver)"])),
        "fork_retained_reuses_prefix": all(prev_prompt <= x["cached"] < x["prompt_tokens"]
                                           for x in runs["fork (retaining saver)"]),
        "plain_reprefilled": all(small(x) for c in CASES for x in runs[f"{c} (plain saver)"]),
        "graph_sends_the_timed_requests": all(g["same_request"] for g in graph.values()),
        "graph_cached_agrees": all(g["cached"] == runs[k][0]["cached"] if k.endswith("(retaining saver)")
                                   else small(g) for k, g in graph.items()),
    }


def accept(acc, res) -> None:
    """The issue-34 row of bench/agent.py's acceptance table."""
    if not res["measured"]:
        acc.add("a replayed LangGraph step after eviction pressure vs a warm turn (issue 34)", "not measured",
                f"<= {ACCEPT_REPLAY:.2f}x", res["why"])
        return
    rows = res["rows"]
    r, p = rows["replay (retaining saver)"]["vs_warm"], rows["replay (plain saver)"]["vs_warm"]
    acc.add("a replayed LangGraph step after eviction pressure vs a warm turn on the same tokens (issue 34)",
            f"{r:.2f}x with RetainingSaver; {p:.2f}x with a plain saver (full re-prefill)",
            f"<= {ACCEPT_REPLAY:.2f}x", "yes" if r <= ACCEPT_REPLAY else "no")


def table(res, a):
    t = C.Table(f"LangGraph replay and fork after store pressure ({C.label('qwen3_5', a.size)}, {a.device}, "
                f"{a.dtype}; --capsule-budget-mb {res['budget_mb']}; median of {a.resume_repeats or a.repeats})",
                ["case", "prompt tok", "cached tok", "new tok", "TTFT ms [min-max]", "vs warm turn"])
    for name, r in res["rows"].items():
        t.add(name, r["prompt_tokens"], r["cached"], r["new"],
              f"{r['ttft_ms']:.1f} [{r['min_ms']:.1f}-{r['max_ms']:.1f}]", C.fmt_ratio(r["vs_warm"]))
    ev = res["pressure"]
    t.notes += [f"a create_react_agent loop of {res['steps']} model calls per saver (its own cache namespace), "
                "greedy; replay: the checkpoint before the last model call re-run (its identical request); fork: "
                "update_state replacing the last tool result, as_node tools, then the next model call",
                f"store pressure each round: {res['traffic']} conversations of ~{res['traffic_tokens']} tokens "
                f"(twice the budget in capsules of {C.fmt_bytes(res['capsule_fixed_bytes'])} + "
                f"{res['capsule_token_bytes']} B/token); a control conversation's cached tokens before -> after: "
                + ", ".join(f"{p['cached_before']} -> {p['cached_after']}" for p in ev)
                + f" of {ev[0]['control_prompt']}",
                "warm turn: the replay's request in a fresh namespace, right after an identical one left its "
                "capsule; every case follows a request in another namespace (no live session reuse)",
                "TTFT: the model call's request sent by httpx, streamed, to the first chunk; the graph's own "
                "replay and fork (run once after) sent the same bodies and got the same cached tokens "
                f"({'checked' if res['checks']['graph_sends_the_timed_requests'] else 'NOT the same'})"]
    return t


def plot_panel(ax, res) -> None:
    names = list(res["rows"])
    ax.bar(range(len(names)), [res["rows"][k]["ttft_ms"] for k in names],
           color=["C0" if "retaining" in k else "C7" if "plain" in k else "C2" for k in names])
    ax.set_xticks(range(len(names)), [k.replace(" saver)", ")").replace(" (", "\n(") for k in names], fontsize=6)
    ax.set_ylabel("TTFT ms (median)")
    ax.set_yscale("log")
    ax.set_title("LangGraph replay / fork after store pressure", fontsize=9)
