"""Routes of /v1/sessions (see conversations.py for what a session is).

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
Model work goes through the engine's methods (remember, save, load_saved), never a session.
"""
from __future__ import annotations

from fastapi import Request

from . import wire
from .engine import wait
from .wire import APIError


def add_session_routes(app, engine, conversations, run) -> None:
    async def on_worker(fut):
        try:
            return await wait(fut)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def ids_of(prompt) -> list:
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt or [])
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < engine.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {ids[bad]} at index {bad} is outside the vocabulary "
                           f"[0, {engine.vocab})", param="prompt")
        return ids

    @app.post("/v1/sessions")
    async def create(request: Request):
        req = wire.parse(wire.SessionCreate, await request.body() or b"{}")
        if req.model and req.model != app.state.model_name:
            raise APIError(404, f"unknown model {req.model!r}", param="model", code="model_not_found")
        ids = ids_of(req.prompt)
        if len(ids) >= engine.max_seq_len:
            raise APIError(400, f"prompt of {len(ids)} tokens exceeds max_seq_len", param="prompt")
        await on_worker(engine.remember(ids))    # first: a failed prefill leaves no session
        return conversations.create(ids).info()

    @app.get("/v1/sessions/{sid}")
    async def get(sid: str):
        return conversations.get(sid).info()

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str):
        conversations.delete(sid)
        return {"id": sid, "deleted": True}

    @app.post("/v1/sessions/{sid}/completions")
    async def turn(sid: str, request: Request):
        s = conversations.get(sid)
        req = wire.parse(wire.CompletionRequest, await request.body())
        p = req.prompt_one()
        new = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        history = s.begin_turn()
        try:
            return await run(request, "text", req, history + new, conversation=s, default_max=16)
        except BaseException:
            if s.busy and not engine.has_turn(s):   # refused before the engine took the turn
                s.end_turn(None)
            raise

    @app.post("/v1/sessions/{sid}/snapshot")
    async def snapshot(sid: str):
        s = conversations.get(sid)
        return {"id": sid, "snapshot_id": s.snapshot(), "position": len(s.tokens)}

    @app.post("/v1/sessions/{sid}/restore")
    async def restore(sid: str, request: Request):
        s = conversations.get(sid)
        req = wire.parse(wire.RestoreRequest, await request.body())
        s.restore(req.snapshot_id)
        return s.info()

    @app.post("/v1/sessions/{sid}/fork")
    async def fork(sid: str):
        s = conversations.get(sid)
        return conversations.create(s.info()["tokens"]).info()

    @app.post("/v1/sessions/{sid}/rollback")
    async def rollback(sid: str, request: Request):
        s = conversations.get(sid)
        req = wire.parse(wire.RollbackRequest, await request.body())
        s.rollback(req.position)
        await on_worker(engine.remember(s.info()["tokens"]))   # the capsule of the rolled-back state
        return s.info()

    def need_disk():
        if not engine.can_save_named:
            raise APIError(400, "save/load by name needs the server started with --capsule-dir")

    @app.post("/v1/sessions/{sid}/save")
    async def save(sid: str, request: Request):
        s = conversations.get(sid)
        req = wire.parse(wire.SaveRequest, await request.body())
        need_disk()
        toks = s.info()["tokens"]
        if not toks:
            raise APIError(400, f"session {sid} is empty: nothing to save")
        try:
            position = await on_worker(engine.save(toks, req.name, req.overwrite))
        except FileExistsError:
            raise APIError(409, f"a session is already saved as {req.name!r}: pass "
                           "\"overwrite\": true to replace it", param="name",
                           code="name_taken") from None
        return {"id": sid, "name": req.name, "position": position}

    @app.post("/v1/sessions/load")
    async def load(request: Request):
        req = wire.parse(wire.NameRequest, await request.body())
        need_disk()
        try:
            toks = await on_worker(engine.load_saved(req.name))
        except KeyError:
            raise APIError(404, f"no saved session named {req.name!r}", param="name") from None
        return conversations.create(toks).info()
