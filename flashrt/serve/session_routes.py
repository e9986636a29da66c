"""Routes of /v1/sessions (see sessions.py for what a session is).

    POST   /v1/sessions                       {"prompt": text | ids}  -> session (prefilled, stored)
    GET    /v1/sessions/{id}                  -> id, position, tokens, snapshots
    DELETE /v1/sessions/{id}
    POST   /v1/sessions/{id}/completions      a completions body; its prompt is APPENDED to the
                                              session, the turn's delivered tokens are kept
    POST   /v1/sessions/{id}/snapshot         -> {"snapshot_id"}
    POST   /v1/sessions/{id}/restore          {"snapshot_id"}
    POST   /v1/sessions/{id}/fork             -> a new session with the same history
    POST   /v1/sessions/{id}/rollback         {"position"}
    POST   /v1/sessions/{id}/save             {"name", "overwrite"?}  (needs --capsule-dir; names
                                              are shared by every client of the server)
    POST   /v1/sessions/load                  {"name"}  -> a new session from the saved capsule
A turn is cancelled like any response: POST /v1/completions/{response_id}/cancel.
"""
from __future__ import annotations

import asyncio

from fastapi import Request

from . import protocol as P


def add_session_routes(app, engine, sessions, run) -> None:
    mem = engine.tiers.mem

    async def on_worker(fn):
        try:
            return await asyncio.wrap_future(engine.call(fn))
        except ValueError as e:
            raise P.APIError(400, str(e)) from None

    def remember(tokens):
        def fn(rt):
            if tokens:
                rt.set_context(tokens, store=mem)
                engine.tiers.remember_turn(rt)
        return fn

    def ids_of(prompt) -> list:
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt or [])
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < engine.vocab), None)
        if bad is not None:
            raise P.APIError(400, f"token id {ids[bad]} at index {bad} is outside the vocabulary "
                             f"[0, {engine.vocab})", param="prompt")
        return ids

    @app.post("/v1/sessions")
    async def create(request: Request):
        req = P.parse(P.SessionCreate, await request.body() or b"{}")
        if req.model and req.model != app.state.model_name:
            raise P.APIError(404, f"unknown model {req.model!r}", param="model", code="model_not_found")
        ids = ids_of(req.prompt)
        if len(ids) >= engine.rt.max_seq_len:
            raise P.APIError(400, f"prompt of {len(ids)} tokens exceeds max_seq_len", param="prompt")
        await on_worker(remember(ids))           # first: a failed prefill leaves no session
        return sessions.create(ids).info()

    @app.get("/v1/sessions/{sid}")
    async def get(sid: str):
        return sessions.get(sid).info()

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str):
        sessions.delete(sid)
        return {"id": sid, "deleted": True}

    @app.post("/v1/sessions/{sid}/completions")
    async def turn(sid: str, request: Request):
        s = sessions.get(sid)
        req = P.parse(P.CompletionRequest, await request.body())
        p = req.prompt_one()
        new = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        history = s.begin_turn()
        try:
            return await run(request, "text", req, history + new, session=s, default_max=16)
        except BaseException:
            if s.busy and not any(j.session is s for j in engine.running()):
                s.end_turn(None)
            raise

    @app.post("/v1/sessions/{sid}/snapshot")
    async def snapshot(sid: str):
        s = sessions.get(sid)
        return {"id": sid, "snapshot_id": s.snapshot(), "position": len(s.tokens)}

    @app.post("/v1/sessions/{sid}/restore")
    async def restore(sid: str, request: Request):
        s = sessions.get(sid)
        req = P.parse(P.RestoreRequest, await request.body())
        s.restore(req.snapshot_id)
        return s.info()

    @app.post("/v1/sessions/{sid}/fork")
    async def fork(sid: str):
        s = sessions.get(sid)
        return sessions.create(s.info()["tokens"]).info()

    @app.post("/v1/sessions/{sid}/rollback")
    async def rollback(sid: str, request: Request):
        s = sessions.get(sid)
        req = P.parse(P.RollbackRequest, await request.body())
        s.rollback(req.position)
        await on_worker(remember(s.info()["tokens"]))     # the capsule of the rolled-back state
        return s.info()

    def need_disk():
        if engine.tiers.disk is None:
            raise P.APIError(400, "save/load by name needs the server started with --capsule-dir")

    @app.post("/v1/sessions/{sid}/save")
    async def save(sid: str, request: Request):
        s = sessions.get(sid)
        req = P.parse(P.SaveRequest, await request.body())
        need_disk()
        toks = s.info()["tokens"]
        if not toks:
            raise P.APIError(400, f"session {sid} is empty: nothing to save")

        def fn(rt):
            rt.set_context(toks, store=mem)
            return engine.tiers.save_named(rt, req.name, req.overwrite)
        try:
            position = await on_worker(fn)
        except FileExistsError:
            raise P.APIError(409, f"a session is already saved as {req.name!r}: pass "
                             "\"overwrite\": true to replace it", param="name",
                             code="name_taken") from None
        return {"id": sid, "name": req.name, "position": position}

    @app.post("/v1/sessions/load")
    async def load(request: Request):
        req = P.parse(P.NameRequest, await request.body())
        need_disk()
        try:
            toks = await on_worker(lambda rt: engine.tiers.load_named(req.name))
        except KeyError:
            raise P.APIError(404, f"no saved session named {req.name!r}", param="name") from None
        return sessions.create(toks).info()
