"""What every request passes before a route sees it, and the connection limits under it.

Guard (ASGI middleware):
  - with API keys: 'Authorization: Bearer KEY' on every path (the scheme in any case), the
    key's tenant put in the scope (scope["flashrt.tenant"]) for the routes;
  - without: the Host header must name the bound address, a localhost name or an
    --allowed-host (DNS rebinding), an Origin header likewise (a web page's request), and a
    body must be sent as JSON (a page's form or text/plain post never reaches a route; a
    multipart form only on FORM_PATHS, the audio and voice uploads, Origin still checked);
  - WebSockets pass the same key, Host and Origin checks (a refusal is an HTTP answer);
  - a body is refused past MAX_BODY (413) or when it does not arrive within read_timeout_s
    (408, then the connection is closed).
protocol(): uvicorn's h11 protocol with a deadline on request heads (uvicorn has none: a
client that never finishes its head held the connection forever).
"""
from __future__ import annotations

import asyncio
import json
import secrets
from urllib.parse import urlsplit

from starlette.responses import Response

from .wire import APIError

MAX_BODY = 8 << 20
MAX_CONNECTIONS = 1024        # open connections (uvicorn's limit_concurrency: a 503 past it)
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})
TENANT = "flashrt.tenant"
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/voices"})   # multipart without a key


def error_response(err: APIError) -> Response:
    """An APIError as OpenAI's JSON error (ASCII-escaped: a client's lone surrogate echoed in
    a message cannot make the body fail to encode)."""
    return Response(json.dumps(err.body(), ensure_ascii=True), status_code=err.status,
                    headers=err.headers, media_type="application/json")


def tenant_of(request) -> str:
    return request.scope.get(TENANT, "")


def host_name(value: str) -> str | None:
    """The host of a Host header value (port and IPv6 brackets dropped, lower case)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else None
    name, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


class Guard:
    def __init__(self, app, keys: dict | None = None, max_body: int = MAX_BODY, *,
                 host: str = "127.0.0.1", allowed_hosts=(), read_timeout_s: float = 30.0):
        """keys: API key -> tenant id (empty or None: no key required)."""
        self.app, self.max_body, self.read_timeout_s = app, max_body, read_timeout_s
        self.keys = [(k.encode("ascii"), t) for k, t in (keys or {}).items()]
        names = {h.lower().strip("[]") for h in allowed_hosts}
        self.any_host = "*" in names
        bound = host.lower().strip("[]")
        self.hosts = LOCAL_NAMES | names | ({bound} if bound not in ("0.0.0.0", "::", "") else set())

    def _tenant(self, headers) -> str | None:
        """The tenant of a request's credentials, or None."""
        scheme, _, cred = headers.get(b"authorization", b"").partition(b" ")
        cred = cred.strip(b" \t")
        if scheme.lower() != b"bearer" or not cred:
            return None
        found = None
        for key, tenant in self.keys:          # every key compared: no early exit to time
            if secrets.compare_digest(cred, key):
                found = tenant
        return found

    def _local_only(self, headers) -> APIError | None:
        """Without a key: the Host and Origin checks that keep web pages (and DNS rebinding) out."""
        if not self.any_host:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                return APIError(421, "Host header names no address this server answers to: use "
                                "127.0.0.1 or localhost, or start it with --allowed-host NAME",
                                code="invalid_host")
            origin = headers.get(b"origin")
            if origin is not None:
                try:
                    o = urlsplit(origin.decode("latin-1")).hostname
                except ValueError:
                    o = None
                if o not in self.hosts:
                    return APIError(403, "requests from web pages of other origins are refused "
                                    "(no API key is set)", code="invalid_origin")
        return None

    @staticmethod
    def _json_body(scope, headers) -> APIError | None:
        """Without a key: a body must be typed JSON (a page's form or text post is not)."""
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return None
        ctype = headers.get(b"content-type")
        if ctype is None:
            length = headers.get(b"content-length", b"0")
            if length.strip() in (b"0", b"") and b"transfer-encoding" not in headers:
                return None                     # no body: nothing to type
        media = (ctype or b"").split(b";", 1)[0].strip().lower()
        if media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json")):
            return None
        if media == b"multipart/form-data" and scope["path"] in FORM_PATHS:
            return None                 # OpenAI's upload is a form; Host and Origin were checked
        return APIError(415, "send the body as JSON: Content-Type: application/json",
                        code="unsupported_media_type")

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys:
            tenant = self._tenant(headers)
            if tenant is None:
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key")
                return await error_response(err)(scope, receive, send)
            scope[TENANT] = tenant
        else:
            err = self._local_only(headers)
            if err is not None:
                return await error_response(err)(scope, receive, send)
        if scope["type"] == "websocket":    # key, Host and Origin as above (answered by denial
            return await self.app(scope, receive, send)   # responses); its route bounds messages
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await error_response(_too_big(int(length), self.max_body))(scope, receive, send)
        if not self.keys:
            err = self._json_body(scope, headers)
            if err is not None:
                return await error_response(err)(scope, receive, send)
        loop = asyncio.get_running_loop()
        seen, done, deadline = 0, False, None

        async def limited():
            nonlocal seen, done, deadline
            if done:                    # the body is in: what follows is a disconnect, waited for
                return await receive()  # as long as a response streams
            if deadline is None:
                deadline = loop.time() + self.read_timeout_s
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.read_timeout_s:g} s",
                               code="request_timeout", headers={"Connection": "close"}) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:     # raised inside the route's body read: the app's
                    raise _too_big(seen, self.max_body)   # APIError handler answers (JSON 413)
                done = not msg.get("more_body", False)
            else:
                done = True
            return msg
        await self.app(scope, limited, send)


def _too_big(n, limit):
    return APIError(413, f"request body of {n}+ bytes exceeds the limit of {limit} bytes",
                    code="body_too_large", headers={"Connection": "close"})


def protocol(read_timeout_s: float):
    """uvicorn's h11 protocol class, with a deadline on request heads: a connection that has
    not sent a whole request head read_timeout_s after it opened (or after its last response
    ended) is closed, with a 408 when part of a head came. A trickle of bytes does not move
    the deadline."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps(APIError(408, f"no complete request head within {read_timeout_s:g} s",
                               code="request_timeout").body()).encode()
    timeout_response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: " + str(len(body)).encode()
                        + b"\r\n\r\n" + body)

    class HeadDeadlineProtocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return (self.conn.their_state is h11.IDLE and not self.transport.is_closing()
                    and (self.cycle is None or self.cycle.response_complete))

        def _watch(self) -> None:
            if not self._waiting_for_head():
                self._disarm()
            elif self._head_timer is None:
                self._head_timer = self.loop.call_later(read_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self._waiting_for_head():
                if self.conn.trailing_data[0]:       # part of a head came: say why (an idle
                    self.transport.write(timeout_response)   # keep-alive one is just closed)
                self.transport.close()

    return HeadDeadlineProtocol
