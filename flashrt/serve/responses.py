"""OpenAI's Responses API over the chat reply path: POST /v1/responses, GET / DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel (barge-in: keep what was delivered).

A response runs as a chat request (responses_wire.py maps it; app.run, replies.py: parser,
grammar, tool calls) whose job id is the response id; its chat reply is refolded into
Responses output items (message, function_call, reasoning) and stream events.

previous_response_id continues from that response's turn end exactly: its token history
(prompt + kept reply tokens) is the new prompt's prefix, and only the new input is rendered
(after a probe user message, so a template that needs one still renders) and prefilled; two
requests naming one response are two forks of it. Stored responses are records of the
durable id-to-history index and hold their turn-end capsules (response_store.py: pinned in
memory, spilled to --capsule-dir, kept across a restart) until deleted or --response-ttl-s.
An Idempotency-Key replays a recorded response (idempotency.py); a response made with
flashrt: {"single_use": true} is continued once (single_use.py: claimed before the lookup).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from flashrt.chat import prepare_messages, template_kwargs

from . import replies, wire
from .engine import wait
from .guard import tenant_of
from .response_index import Record as Stored       # a stored response's record
from .response_store import ResponseStore, add_retain_routes
from .responses_wire import ResponsesRequest
from .wire import APIError, check_text

PROBE = [{"role": "user", "content": "."}]     # what the new input is rendered after


def add_responses_routes(app, engine, options, run, prompts) -> ResponseStore:
    """The /v1/responses routes and /v1/flashrt/{retain,release}; returns their store."""
    store = ResponseStore(engine, options)
    add_retain_routes(app, store)
    model_name = app.state.model_name

    @app.post("/v1/responses")
    async def create(request: Request):
        raw = await request.body()
        req = wire.parse(ResponsesRequest, raw)
        rid = wire.new_id("resp")       # first: a single-use claim names its winner before it runs
        return await app.state.idempotency.run(request, "responses", raw, lambda: app.state.continuations.run(
            request, req, rid, lambda turn: respond(request, req, rid, turn)))

    async def respond(request, req, rid: str, turn):
        tenant = tenant_of(request)
        store.check_room(req.store)
        prev = None
        if req.previous_response_id is not None:
            prev = await store.get(req.previous_response_id, tenant, "previous_response_id")
            await turn.stored(prev)
            if req.instructions is not None and req.instructions != prev.instructions:
                raise APIError(400, "instructions differ from those of previous_response_id's conversation, "
                               "whose tokens are continued as they are: send the same, or none",
                               param="instructions")
            if req.tools is None:       # the history holds its tools: its calls are read with them
                req = req.model_copy(update={"tools": prev.tools})
            elif req.tools != prev.tools:
                raise APIError(400, "tools differ from those previous_response_id's conversation was "
                               "rendered with, whose tokens are continued as they are: send the same, or none",
                               param="tools")
            chat_req = req.chat_request(req.messages(with_instructions=False))
            ids, plan = await asyncio.to_thread(_continue, engine, prompts.template, chat_req, prev.history)
            pin = 0
        else:
            chat_req = req.chat_request(req.messages())
            ids, pin, plan = await prompts.chat(chat_req)
        reply = Reply(rid, model_name, req, prev)
        single = req.flashrt is not None and req.flashrt.single_use

        async def keep(job_id: str, body: dict) -> None:
            if req.store:
                job = engine.job(job_id)
                kept = job.kept[0] if job.kept is not None else len(job.choices[0].ids)
                history = list(job.prompt) + list(job.choices[0].ids[:kept])
                await store.put(rid, Stored(body, history, tenant, job.ns, time.time() + store.ttl_s,
                                            prev.instructions if prev else req.instructions, req.tools,
                                            single_use=single))
                if single:
                    await app.state.continuations.mark(tenant, rid)

        out = await run(request, "chat", chat_req, ids, pin=pin, plan=plan, rid=rid)
        if not req.stream:
            body = reply.from_chat(out)
            await keep(rid, body)
            return body
        return StreamingResponse(reply.events(out.body_iterator, keep), media_type="text/event-stream")

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, request: Request):
        return (await store.get(rid, tenant_of(request))).body

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request):
        await store.delete(rid, tenant_of(request))
        return {"id": rid, "object": "response", "deleted": True}

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel(rid: str, request: Request):
        body = await request.body()
        creq = wire.parse(wire.CancelRequest, body or b"{}")
        tenant = tenant_of(request)
        kind, vals = creq.per_choice(engine.job(rid, tenant).n)
        kept = await wait(engine.cancel(rid, kind, vals).kept)
        job = engine.job(rid, tenant)
        s = store.find(rid)
        if s is not None:             # finished and stored: it now continues from what was kept
            history = list(job.prompt) + list(job.choices[0].ids[: kept[0]])
            s.body = {**s.body, "status": "cancelled"}
            await store.put(rid, Stored(s.body, history, s.tenant, s.ns, s.expires, s.instructions, s.tools,
                                        single_use=s.single_use))
        return {"id": rid, "object": "response", "cancelled": True, "kept_tokens": kept}
    return store


def _continue(engine, template, chat_req, history: list) -> tuple:
    """(ids, replies.Plan) of new input after a stored history: history + the tokens of the
    turn-end separator and the new messages as the template renders them after a probe user
    message. A history cut before its turn-end token (length, cancel) gets it appended."""
    tok = engine.tokenizer
    try:
        msgs = prepare_messages([m.model_dump(exclude_none=True) for m in chat_req.messages], template.family)
        extra = template_kwargs(getattr(chat_req, "chat_template_kwargs", None), chat_req.reasoning_effort)
        before = template.render(PROBE, add_generation_prompt=False, template_kwargs=extra)
        after = template.render(PROBE + msgs, add_generation_prompt=True, template_kwargs=extra)
    except ValueError as e:
        raise APIError(400, str(e), param="input") from None
    if not after.startswith(before):
        raise APIError(400, "this chat template renders the new input differently after a conversation "
                       "than alone: it cannot continue previous_response_id", param="previous_response_id")
    new = check_text(after[len(before):], "input")
    ends = [(before.rfind(t), t) for t in (tok.decode([e]) for e in sorted(engine.turns.eos)) if t]
    at, end = max(ends) if ends else (-1, "")
    sep = before[at + len(end):] if at >= 0 else ""
    if not history or history[-1] not in engine.turns.eos:
        sep = end + sep
    ids = list(history) + tok.encode(sep + new)
    if len(ids) >= engine.max_seq_len:
        raise APIError(400, f"the conversation ({len(history)} tokens) and the new input come to {len(ids)} "
                       f"tokens, leaving no room to generate: max_seq_len is {engine.max_seq_len}",
                       param="input", code="context_length_exceeded")
    plan = replies.plan(chat_req, template, new)
    if plan.grammar is not None:
        engine.compile_grammar(plan.grammar)
    return ids, plan


class Reply:
    """One response's Response objects: from a chat completion (from_chat) or refolded from its
    chat stream into Responses events (events)."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, prev):
        self.rid, self.model, self.req, self.created = rid, model, req, wire.now()
        self.prev = req.previous_response_id if prev is not None else None
        self.seq = 0

    def shell(self, status: str, output: list, usage=None, reason=None) -> dict:
        r = self.req
        fmt = {"type": "text"}
        if r.text is not None and r.text.format is not None:
            fmt = r.text.format.model_dump(by_alias=True, exclude_none=True)
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": reason} if reason else None,
                "instructions": r.instructions, "tools": r.tools or [], "tool_choice": r.tool_choice or "auto",
                "parallel_tool_calls": r.parallel_tool_calls, "temperature": r.temperature,
                "top_p": r.top_p, "max_output_tokens": r.max_output_tokens,
                "previous_response_id": self.prev, "store": r.store, "text": {"format": fmt},
                "reasoning": r.reasoning.model_dump() if r.reasoning else None,
                "metadata": r.metadata or {}, "truncation": r.truncation or "disabled"}

    @staticmethod
    def usage(u: dict) -> dict:
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    @staticmethod
    def status(finish: str | None) -> tuple:
        """(status, incomplete reason) of a chat finish_reason."""
        if finish == "length":
            return "incomplete", "max_output_tokens"
        if finish == "cancelled":
            return "cancelled", None
        return "completed", None

    def from_chat(self, chat: dict) -> dict:
        c = chat["choices"][0]
        m, items = c["message"], []
        if m.get("reasoning_content"):
            items.append(_reasoning(self.rid, m["reasoning_content"]))
        if m.get("content") or not m.get("tool_calls"):
            items.append(_message(self.rid, m.get("content") or ""))
        for t in m.get("tool_calls") or ():
            items.append(_call(t["id"], t["function"]["name"], t["function"]["arguments"]))
        status, reason = self.status(c["finish_reason"])
        return self.shell(status, items, self.usage(chat["usage"]), reason)

    def _event(self, kind: str, **fields) -> str:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(ev)}\n\n"

    async def events(self, chunks, keep):
        """The chat stream's chunks (SSE strings) -> Responses events. One item is open at a time
        (reasoning, message text, a function call); another kind, or a new call, closes it."""
        yield self._event("response.created", response=self.shell("in_progress", []))
        yield self._event("response.in_progress", response=self.shell("in_progress", []))
        self._done, self._item = [], None
        finish, usage, job_id = None, None, self.rid
        async with contextlib.aclosing(chunks) as it:
            async for raw in it:
                data = raw.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                c = json.loads(data)
                if "error" in c:
                    e = c["error"]
                    yield self._event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
                    yield self._event("response.failed", response={**self.shell("failed", self._done), "error": {
                        "code": e.get("code") or "server_error", "message": e.get("message")}})
                    return
                job_id = c.get("id", job_id)
                usage = c.get("usage") or usage
                for ch in c.get("choices", ()):
                    for ev in self._feed(ch.get("delta", {})):
                        yield ev
                    finish = ch.get("finish_reason") or finish
        if not self._done and self._item is None:   # no text came: an empty message, as from_chat
            for ev in self._start(_message(self.rid, "")):
                yield ev
        for ev in self._close():
            yield ev
        status, reason = self.status(finish)
        body = self.shell(status, self._done, self.usage(usage) if usage else None, reason)
        await keep(job_id, body)
        yield self._event("response.completed" if status == "completed" else "response.incomplete",
                          response=body)

    def _feed(self, d: dict) -> list:
        """Events of one chat delta (reasoning_content, content, tool_calls)."""
        out = []
        if d.get("reasoning_content"):
            out += self._open("reasoning")
            self._item["content"][0]["text"] += d["reasoning_content"]
            out.append(self._event("response.reasoning_text.delta", item_id=self._item["id"],
                                   output_index=len(self._done), content_index=0, delta=d["reasoning_content"]))
        if d.get("content"):
            out += self._open("message")
            self._item["content"][0]["text"] += d["content"]
            out.append(self._event("response.output_text.delta", item_id=self._item["id"],
                                   output_index=len(self._done), content_index=0, delta=d["content"], logprobs=[]))
        for t in d.get("tool_calls") or ():
            if "id" in t:           # a call's first delta names it: a new item
                out += self._close() + self._start(_call(t["id"], t["function"]["name"], ""))
            frag = t.get("function", {}).get("arguments", "")
            if frag and self._item is not None and self._item["type"] == "function_call":
                self._item["arguments"] += frag
                out.append(self._event("response.function_call_arguments.delta", item_id=self._item["id"],
                                       output_index=len(self._done), delta=frag))
        return out

    def _open(self, kind: str) -> list:
        """The open item is of `kind` (a new one started, closing another)."""
        if self._item is not None and self._item["type"] == kind:
            return []
        return self._close() + self._start(_reasoning(self.rid, "") if kind == "reasoning" else _message(self.rid, ""))

    def _start(self, item: dict) -> list:
        self._item, i = item, len(self._done)
        shown = {**item, "status": "in_progress"}
        if item["type"] == "message":
            shown["content"] = []
        out = [self._event("response.output_item.added", output_index=i, item=shown)]
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=i,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _close(self) -> list:
        it, i, out = self._item, len(self._done), []
        if it is None:
            return out
        if it["type"] == "message":
            out.append(self._event("response.output_text.done", item_id=it["id"], output_index=i,
                                   content_index=0, text=it["content"][0]["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=it["id"], output_index=i,
                                   content_index=0, part=it["content"][0]))
        elif it["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=it["id"], output_index=i,
                                   arguments=it["arguments"], name=it["name"]))
        else:
            out.append(self._event("response.reasoning_text.done", item_id=it["id"], output_index=i,
                                   content_index=0, text=it["content"][0]["text"]))
        it["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=i, item=it))
        self._done.append(it)
        self._item = None
        return out


def _message(rid: str, text: str) -> dict:
    return {"type": "message", "id": wire.new_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning(rid: str, text: str) -> dict:
    return {"type": "reasoning", "id": wire.new_id("rs"), "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": wire.new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}
