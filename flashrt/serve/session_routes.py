"""Routes of /v1/sessions (see conversations.py for what a session is).

    POST   /v1/sessions                       {"prompt": text | ids}  -> session (prefilled, stored)
    GET    /v1/sessions/{id}                  -> id, position, tokens, snapshots
    DELETE /v1/sessions/{id}
    POST   /v1/sessions/{id}/completions      a completions body (response_format too); its prompt
                                              is APPENDED to the session, the turn's delivered
                                              tokens are kept; an empty one continues the session
                                              (under the same response_format, the grammar state
                                              a cut left: conversations.py)
    POST   /v1/sessions/{id}/snapshot         -> {"snapshot_id"}
    POST   /v1/sessions/{id}/restore          {"snapshot_id"}
    POST   /v1/sessions/{id}/fork             -> a new session with the same history
    POST   /v1/sessions/{id}/rollback         {"position"}
    POST   /v1/sessions/{id}/save             {"name", "overwrite"?}  (needs --capsule-dir; names
                                              are the API key's own)
    POST   /v1/sessions/load                  {"name", "cache_salt"?}  -> a new session from the
                                              saved capsule
A turn is cancelled like any response: POST /v1/completions/{response_id}/cancel.
Model work goes through the engine's methods (remember, save, load_saved), never a session.
A session belongs to the tenant (API key) that made it, and its turns reuse capsules only in
its namespace (the tenant's, or with "cache_salt" at creation the tenant's and salt's).
"""
from __future__ import annotations

from fastapi import Request

from flashrt.capsules import NamedLimitError
from flashrt.errors import CapsuleCorruptError, CapsuleMismatchError

from . import wire
from .engine import wait
from .guard import tenant_of
from .tenants import namespace
from .wire import APIError


def add_session_routes(app, engine, conversations, run, prompts) -> None:
    async def on_worker(fut):
        try:
            return await wait(fut)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def ids_of(prompt) -> list:
        if isinstance(prompt, list) and len(prompt) >= engine.max_seq_len:
            raise APIError(400, f"prompt of {len(prompt)} tokens exceeds max_seq_len", param="prompt",
                           code="context_length_exceeded")
        ids = await prompts.ids(prompt)
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < engine.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {ids[bad]} at index {bad} is outside the vocabulary "
                           f"[0, {engine.vocab})", param="prompt")
        return ids

    def mine(sid: str, request: Request):
        return conversations.get(sid, tenant_of(request))

    @app.post("/v1/sessions")
    async def create(request: Request):
        req = wire.parse(wire.SessionCreate, await request.body() or b"{}")
        if req.model and req.model != app.state.model_name:
            raise APIError(404, f"unknown model {req.model!r}", param="model", code="model_not_found")
        ids = await ids_of(req.prompt)
        if len(ids) >= engine.max_seq_len:
            raise APIError(400, f"prompt of {len(ids)} tokens exceeds max_seq_len", param="prompt",
                           code="context_length_exceeded")
        tenant = tenant_of(request)
        ns = namespace(tenant, req.cache_salt)
        await on_worker(engine.remember(ids, ns))    # first: a failed prefill leaves no session
        return conversations.create(ids, tenant, ns).info()

    @app.get("/v1/sessions/{sid}")
    async def get(sid: str, request: Request):
        return mine(sid, request).info()

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str, request: Request):
        conversations.delete(sid, tenant_of(request))
        return {"id": sid, "deleted": True}

    @app.post("/v1/sessions/{sid}/completions")
    async def turn(sid: str, request: Request):
        s = mine(sid, request)
        req = wire.parse(wire.CompletionRequest, await request.body())
        new = await prompts.ids(req.prompt_one(empty_ok=True))
        plan = await prompts.completion_plan(req)
        history, grammar = s.begin_turn()
        try:
            if not history and not new:
                raise APIError(400, f"prompt is empty and so is session {sid}: nothing to continue",
                               param="prompt")
            return await run(request, "text", req, history + new, conversation=s, default_max=16,
                             plan=plan, resume=None if new else grammar)
        except BaseException:
            if s.busy and not engine.has_turn(s):   # refused before the engine took the turn
                s.end_turn(None)
            raise

    @app.post("/v1/sessions/{sid}/snapshot")
    async def snapshot(sid: str, request: Request):
        s = mine(sid, request)
        snap = s.snapshot()
        return {"id": sid, "snapshot_id": snap, "position": len(s.history())}

    @app.post("/v1/sessions/{sid}/restore")
    async def restore(sid: str, request: Request):
        s = mine(sid, request)
        req = wire.parse(wire.RestoreRequest, await request.body())
        s.restore(req.snapshot_id)
        return s.info()

    @app.post("/v1/sessions/{sid}/fork")
    async def fork(sid: str, request: Request):
        s = mine(sid, request)                        # the fork shares the history (no copy)
        tokens, grammar = s.state()
        return conversations.create(tokens, s.tenant, s.ns, grammar).info()

    @app.post("/v1/sessions/{sid}/rollback")
    async def rollback(sid: str, request: Request):
        s = mine(sid, request)
        req = wire.parse(wire.RollbackRequest, await request.body())
        s.rollback(req.position)
        await on_worker(engine.remember(s.history(), s.ns))   # the capsule of the rolled-back state
        return s.info()

    def need_disk():
        if not engine.can_save_named:
            raise APIError(400, "save/load by name needs the server started with --capsule-dir")

    @app.post("/v1/sessions/{sid}/save")
    async def save(sid: str, request: Request):
        s = mine(sid, request)
        req = wire.parse(wire.SaveRequest, await request.body())
        need_disk()
        toks = s.history()
        if not toks:
            raise APIError(400, f"session {sid} is empty: nothing to save")
        try:
            position = await on_worker(engine.save(toks, req.name, req.overwrite, s.tenant, s.ns))
        except FileExistsError:
            raise APIError(409, f"a session is already saved as {req.name!r}: pass "
                           "\"overwrite\": true to replace it", param="name",
                           code="name_taken") from None
        except NamedLimitError as e:
            if e.limit == "count":
                raise APIError(429, f"this API key has {e.value} sessions saved by name, the most "
                               "it may (--max-named-per-key): overwrite one", param="name",
                               type="rate_limit_error", code="named_quota") from None
            raise APIError(507, f"no room for another saved session: named saves hold their "
                           f"budget (--capsule-named-mb, {e.value} B)", type="server_error",
                           code="named_budget_full") from None
        return {"id": sid, "name": req.name, "position": position}

    @app.post("/v1/sessions/load")
    async def load(request: Request):
        req = wire.parse(wire.LoadRequest, await request.body())
        need_disk()
        tenant = tenant_of(request)
        ns = namespace(tenant, req.cache_salt)
        try:
            toks = await on_worker(engine.load_saved(req.name, tenant, ns))
        except KeyError:
            raise APIError(404, f"no saved session named {req.name!r}", param="name") from None
        except CapsuleMismatchError as e:
            raise APIError(409, f"saved session {req.name!r} cannot be loaded here: "
                           f"{str(e).split(': ', 1)[-1]}", param="name", code="model_mismatch") from None
        except CapsuleCorruptError:
            raise APIError(500, f"saved session {req.name!r} is damaged: it was moved aside and "
                           "can no longer be loaded by this name", type="server_error",
                           code="saved_session_damaged") from None
        return conversations.create(toks, tenant, ns).info()
