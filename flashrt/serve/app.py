"""FastAPI routes: parse (wire.py), hand a Job to the engine, stream its events back.

OpenAI endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, plus
POST /v1/{chat/completions,completions}/{id}/cancel (barge-in). Sessions: session_routes.py.
Responses (/v1/responses): responses.py.

The event loop does no work that grows with a client's input beyond parsing its body: text
longer than the context can hold is refused by its length, and templates and tokenizing run
on a thread (Prompts). Every answer, errors included, is JSON in OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException

from flashrt.chat import prepare_messages, template_kwargs

from . import chat_wire, idempotency, replies, wire
from .conversations import ConversationTable
from .engine import Choice, Job, new_seed, wait
from .events import FINAL, Cancelled, Delta, Done, Failed, Finished
# the limits of every request (API key, Host, content type, body size and timeouts): guard.py
from .guard import MAX_BODY, Guard, error_response, tenant_of  # noqa: F401 (MAX_BODY, Guard: old home)
from .options import ServeOptions
from .single_use import Continuations
from .tenants import namespace
from .text import TextStream
from .wire import APIError, check_text


def create_app(engine, template, model_name: str, options: ServeOptions) -> FastAPI:
    """The routes over a started engine (API key and body limit: see Guard)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # inside uvicorn's graceful shutdown: on SIGTERM uvicorn re-raises the signal after
        # it, and the process dies before the caller's own cleanup would run
        await asyncio.to_thread(responses.close)       # queued record writes
        await asyncio.to_thread(engine.close)
        print("flashrt serve: stopped; turn capsules flushed", file=sys.stderr, flush=True)
    app = FastAPI(title="flashrt serve", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    conversations = ConversationTable(idle_s=options.session_idle_s, per_key=options.max_sessions_per_key,
                                      tokens_per_key=options.session_tokens_per_key)
    app.state.model_name = model_name
    shared = idempotency.shared(options)        # Idempotency-Key records, single-use claims
    app.state.idempotency = idempotency.Idempotency(options, shared)
    app.state.continuations = Continuations(options, shared)
    rt_max = engine.max_seq_len
    prompts = Prompts(engine, template)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        return error_response(APIError(exc.status_code, f"{exc.detail}: {request.method} "
                                       f"{wire._echo(request.url.path, 200)}",
                                       code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):     # a bug: logged by uvicorn, still JSON
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    def check_model(req):
        if req.model and req.model != model_name:
            raise APIError(404, f"unknown model {req.model!r}: this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def check_prompt(ids: list, req) -> int:
        if len(ids) >= rt_max:        # first: a long list is refused without a pass over it
            raise APIError(400, f"prompt of {len(ids)} tokens leaves no room to generate: "
                           f"max_seq_len is {rt_max}", param="prompt", code="context_length_exceeded")
        bad = next((j for j, t in enumerate(ids) if not (isinstance(t, int) and 0 <= t < engine.vocab)), None)
        if bad is not None:
            raise APIError(400, f"token id {ids[bad]!r} at index {bad} is outside the vocabulary "
                           f"[0, {engine.vocab})", param="prompt")
        limit = req.limit()
        if limit is not None and limit > rt_max:
            raise APIError(400, f"{req.limit_field()} {limit} exceeds max_seq_len {rt_max}",
                           param=req.limit_field())
        if isinstance(req.pin_prefix, int) and not 0 <= req.pin_prefix <= len(ids):
            raise APIError(400, f"pin_prefix {req.pin_prefix} is outside the prompt [0, {len(ids)}]",
                           param="pin_prefix")
        room = rt_max - len(ids)
        return min(limit, room) if limit is not None else room

    async def run(request, kind, req, ids, pin=0, conversation=None, default_max=None, plan=None,
                  resume=None, rid=None, record=False):
        """plan: a chat reply's or completion's (replies.Plan: parser and grammar); logit_bias
        applies to all. resume: a session turn that appends nothing: the session's grammar state.
        rid: the job's id (default: a new chatcmpl- / cmpl- one). record: a chat completion's id
        goes into the response index once it finishes (retain, response_store.py)."""
        check_model(req)
        tenant = tenant_of(request)
        if conversation is not None:
            if req.cache_salt is not None and namespace(tenant, req.cache_salt) != conversation.ns:
                raise APIError(400, "cache_salt differs from the session's (set when it was made)",
                               param="cache_salt")
            ns = conversation.ns
        else:
            ns = namespace(tenant, req.cache_salt)
        max_tokens = check_prompt(ids, req)
        if default_max is not None and req.limit() is None:
            max_tokens = min(max_tokens, default_max)
        if isinstance(req.pin_prefix, int):
            pin = req.pin_prefix
        if conversation is not None and req.n != 1:
            raise APIError(400, "n must be 1 in a session turn", param="n")
        decoding = replies.decoding(req, plan, engine.vocab)
        if decoding.steered and options.draft_tokens:
            which = "logit_bias" if decoding.bias else "logprobs"
            raise APIError(400, f"{which} is not available on a server decoding speculatively "
                           f"(--draft-tokens {options.draft_tokens})", param=which)
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        base = req.seed if req.seed is not None else new_seed()
        job = Job(id=rid or wire.new_id("chatcmpl" if kind == "chat" else "cmpl"), prompt=ids, n=req.n,
                  max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                  seed=req.seed, stops=req.stops(), pin=pin, conversation=conversation,
                  ignore_eos=req.ignore_eos, decoding=decoding, tenant=tenant, ns=ns, resume=resume,
                  post=lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        job.choices = [Choice(i, TextStream(engine.tokenizer, job.stops), base + i) for i in range(req.n)]
        engine.submit(job)
        if record:
            responses.watch(job)
        if req.stream:
            return StreamingResponse(_sse(engine, job, q, kind, model_name, req, plan),
                                     media_type="text/event-stream")
        return await _collect(request, engine, job, q, kind, model_name, plan)

    # the language model first, then the speech models (added with their routes, below)
    cards = [{"id": model_name, "object": "model", "created": 0, "owned_by": "flashrt",
              "max_seq_len": rt_max}]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        card = next((c for c in cards if c["id"] == name), None)
        if card is None:
            raise APIError(404, f"unknown model {wire._echo(name)}: this server serves "
                           f"{', '.join(repr(c['id']) for c in cards)}", param="model", code="model_not_found")
        return card

    @app.get("/health")
    async def health():
        if engine.error:
            raise APIError(503, engine.error, type="server_error")
        return {"status": "ok"}

    @app.get("/v1/flashrt/stats")
    async def stats(request: Request):      # the caller's own jobs; the response store's totals
        return {"object": "flashrt.stats", "jobs": engine.jobs.get(tenant_of(request), 0),
                "responses": responses.stats()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.body()
        req = wire.parse(chat_wire.ChatRequest, body)

        async def answer():
            ids, pin, plan = await prompts.chat(req)
            return await run(request, "chat", req, ids, pin=pin, plan=plan, record=True)
        return await app.state.idempotency.run(request, "chat", body, answer)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = wire.parse(wire.CompletionRequest, await request.body())
        p = req.prompt_one()
        if req.pin_prefix == "system":
            raise APIError(400, "pin_prefix='system' needs chat messages; give a token count",
                           param="pin_prefix")
        ids = await prompts.ids(p)
        return await run(request, "text", req, ids, default_max=16, plan=await prompts.completion_plan(req))

    async def cancel(rid: str, request: Request):
        body = await request.body()
        req = wire.parse(wire.CancelRequest, body or b"{}")
        kind, vals = req.per_choice(engine.job(rid, tenant_of(request)).n)
        cancellation = engine.cancel(rid, kind, vals)
        kept = await wait(cancellation.kept)
        await responses.cut(rid, tenant_of(request), kept)      # a chat completion's record follows
        return {"id": cancellation.id, "cancelled": True, "kept_tokens": kept}

    app.post("/v1/chat/completions/{rid}/cancel")(cancel)
    app.post("/v1/completions/{rid}/cancel")(cancel)

    from .session_routes import add_session_routes
    add_session_routes(app, engine, conversations, run, prompts)
    from .responses import add_responses_routes     # /v1/responses over the chat reply path
    # the response index: stored responses, chat completion ids (run(record=True)), retains
    responses = add_responses_routes(app, engine, options, run, prompts)
    from .audio import add_audio_routes     # speech in: /v1/audio/transcriptions, /v1/realtime
    from .speech import add_speech_routes   # speech out: /v1/audio/speech, /v1/audio/voices
    from .voice_session import add_voice_routes     # the voice agent: /v1/voice
    audio, speech = add_audio_routes(app, options), add_speech_routes(app, options)
    for worker in (audio, speech):
        if worker is not None:
            cards.append({"id": worker.name, "object": "model", "created": 0, "owned_by": "flashrt"})
    add_voice_routes(app, options, engine, audio, speech)
    return app


class Prompts:
    """Client text -> token ids, off the event loop. Text longer than the context can hold
    (engine.max_text_chars) is refused before anything reads it; a lone surrogate is a 400."""

    def __init__(self, engine, template):
        self.engine, self.template = engine, template

    def _too_long(self, chars: int, param: str) -> APIError:
        e = self.engine
        return APIError(400, f"{param} of {chars} characters cannot fit in max_seq_len {e.max_seq_len} "
                        f"tokens (a token of this tokenizer covers at most "
                        f"{e.max_text_chars // e.max_seq_len} characters): refused unread", param=param,
                        code="context_length_exceeded")

    def _check(self, text: str, param: str) -> str:
        if len(text) > self.engine.max_text_chars:
            raise self._too_long(len(text), param)
        return check_text(text, param)

    async def ids(self, prompt, param: str = "prompt") -> list:
        """A prompt (text or ids) as ids; text is tokenized on a thread."""
        if not isinstance(prompt, str):
            return list(prompt or [])
        self._check(prompt, param)
        return await asyncio.to_thread(self.engine.tokenizer.encode, prompt)

    async def completion_plan(self, req):
        """replies.Plan of a completion's response_format (None without one), its grammar
        compiled off the event loop (a refused one is a 400 before the request queues)."""
        plan = replies.completion_plan(req)
        if plan is not None:
            await asyncio.to_thread(self.engine.compile_grammar, plan.grammar)
        return plan

    async def chat(self, req) -> tuple:
        """(ids, pinned prefix length) of a chat request's messages under the template, prepared
        for it (flashrt.chat.prepare_messages: tool calls, tool results, reasoning)."""
        try:
            msgs = prepare_messages([m.model_dump(exclude_none=True) for m in req.messages],
                                    self.template.family)
        except ValueError as e:     # it names messages[i] and the field first
            raise APIError(400, str(e), param=_named(str(e), "messages")) from None
        if req.tools and self.template.kind == "plain":
            raise APIError(400, "tools need the model's chat template, and this checkpoint has none "
                           "(tokenizer_config.json chat_template or chat_template.jinja)", param="tools")
        # tools, chat_template_kwargs, reasoning_effort: fields chat_wire.ChatRequest declares
        effort = getattr(req, "reasoning_effort", None)
        try:
            extra = template_kwargs(getattr(req, "chat_template_kwargs", None), effort)
        except ValueError as e:
            raise APIError(400, str(e), param="reasoning_effort" if effort else "chat_template_kwargs") from None
        total = sum(len(m["content"]) for m in msgs)
        if total > self.engine.max_text_chars:
            raise self._too_long(total, "messages")
        for m in msgs:
            check_text(m["content"], "messages")
        render = functools.partial(self.template.render, tools=getattr(req, "tools", None), template_kwargs=extra)
        return await asyncio.to_thread(self._render, render, msgs, req)

    def _render(self, render, msgs, req) -> tuple:
        """(ids, pinned prefix length, replies.Plan: how the reply is parsed and constrained)."""
        tok, pin_system = self.engine.tokenizer, req.pin_prefix == "system"
        try:
            text = check_text(render(msgs), "messages")     # tool arguments and reasoning too
            ids = tok.encode(text)
            pin = 0
            if pin_system:
                sys_msgs = msgs[: next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))]
                pre = tok.encode(render(sys_msgs, add_generation_prompt=False)) if sys_msgs else []
                if ids[: len(pre)] != pre:
                    raise ValueError("pin_prefix='system': the rendered system messages are not a "
                                     "token prefix of the prompt under this template")
                pin = len(pre)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        plan = replies.plan(req, self.template, text)
        if plan.grammar is not None:
            self.engine.compile_grammar(plan.grammar)
        return ids, pin, plan


def _named(message: str, default: str) -> str:
    """The parameter a flashrt.chat error names first (`messages[2].tool_calls[0]...`)."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.startswith(default + "[") else default


async def _events(job, q):
    while True:
        ev = await q.get()
        yield ev
        if isinstance(ev, FINAL):
            return


def _replies(kind, job, plan) -> list:
    """One replies.ReplyStream per choice of a chat response (the same for stream or not)."""
    return [replies.ReplyStream(plan) for _ in range(job.n)] if kind == "chat" else [None] * job.n


def _logprobs(engine, job, items) -> dict | None:
    if job.decoding.logprobs is None:
        return None
    return {"content": replies.logprobs_content(engine.tokenizer, items), "refusal": None}


async def _collect(request, engine, job, q, kind, model_name, plan=None):
    texts, finish, ids = [""] * job.n, [None] * job.n, [[] for _ in range(job.n)]
    reply, lps = _replies(kind, job, plan), [[] for _ in range(job.n)]
    created, gone, checked = wire.now(), False, time.monotonic()
    while True:
        try:
            ev = await asyncio.wait_for(q.get(), timeout=0.25)
        except asyncio.TimeoutError:
            ev = None
        # every 0.25 s whether or not tokens flow: a client gone mid-answer frees its session
        if not gone and time.monotonic() - checked >= 0.25 and job.phase != "done":
            checked = time.monotonic()
            if await request.is_disconnected():
                gone = True
                engine.cancel(job.id, "tokens", [0] * job.n)    # nothing was delivered
        if ev is None:
            continue
        if isinstance(ev, Delta):
            texts[ev.index] += ev.text
            lps[ev.index] += ev.logprobs
            if reply[ev.index] is not None:
                reply[ev.index].feed(ev.text)
        elif isinstance(ev, Finished):
            finish[ev.index], ids[ev.index] = ev.reason, list(ev.token_ids)
            if reply[ev.index] is not None:
                reply[ev.index].finish()
                finish[ev.index] = reply[ev.index].finish_reason(ev.reason)
        elif isinstance(ev, Failed):
            raise ev.error
        elif isinstance(ev, Cancelled):
            raise APIError(499, "request cancelled before it started", code="cancelled")
        elif isinstance(ev, Done):
            choices = [wire.choice(kind, i, texts[i], finish[i], ids[i],
                                   reply[i].message() if reply[i] is not None else None,
                                   _logprobs(engine, job, lps[i])) for i in range(job.n)]
            return wire.response(kind, job.id, model_name, choices, _usage(ev), created)


async def _sse(engine, job, q, kind, model_name, req, plan=None):
    created, done = wire.now(), False
    first, sent, reply = [True] * job.n, [0] * job.n, _replies(kind, job, plan)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        async for ev in _events(job, q):
            if isinstance(ev, Delta):
                if job.cancel is not None:             # cut: these tokens are being rolled back
                    continue
                i, new = ev.index, list(ev.token_ids)
                text, fields = reply[i].feed(ev.text) if reply[i] is not None else (ev.text, {})
                c = wire.chunk(kind, job.id, model_name, created, i, text, None, ev.token_index, new, first[i],
                               fields, _logprobs(engine, job, ev.logprobs) if ev.logprobs else None)
                first[i], sent[i] = False, sent[i] + len(new)
                yield f"data: {json.dumps(c)}\n\n"
                job.delivered[i] = sent[i]             # reached here: the chunk was handed to the socket
            elif isinstance(ev, Finished):
                i = ev.index
                rest = list(ev.token_ids[sent[i]:])    # an EOS id: its token has no text
                text, fields, reason = None, {}, ev.reason
                if reply[i] is not None:               # the parser's held text, an open call closed
                    (text, fields), reason = reply[i].finish(), reply[i].finish_reason(ev.reason)
                c = wire.chunk(kind, job.id, model_name, created, i, text, reason, ev.token_index, rest,
                               first[i], fields)
                first[i], sent[i] = False, sent[i] + len(rest)
                yield f"data: {json.dumps(c)}\n\n"
                job.delivered[i] = sent[i]
            elif isinstance(ev, Failed):
                done = True
                yield f"data: {json.dumps(ev.error.body())}\n\n"
            elif isinstance(ev, (Done, Cancelled)):
                done = True
                if include_usage and isinstance(ev, Done):
                    u = {"id": job.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                         "created": created, "model": model_name, "choices": [], "usage": _usage(ev)}
                    yield f"data: {json.dumps(u)}\n\n"
                yield "data: [DONE]\n\n"
    finally:
        if not done:                                   # a bare disconnect keeps what was sent
            try:
                engine.cancel(job.id, "tokens", None)
            except APIError:
                pass


def _usage(done: Done) -> dict:
    return wire.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
