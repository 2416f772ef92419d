"""The console's HTTP face: a thin Starlette app over :class:`~.service.Console`.

| route | what |
|---|---|
| ``GET /`` | the page (the login form first when login is on) |
| ``GET /static/...`` | the page's CSS, JavaScript and icon (package data) |
| ``GET /api/snapshot`` | a snapshot document with every section (JSON) |
| ``GET /api/events?view=V`` | server-sent events: each new document (or its delta) for V |
| ``GET /api/describe?target=G`` | G's members and their declarations (the call form) |
| ``GET /api/traffic?kind=&sender=&target=`` | server-sent events: live traffic records |
| ``POST /api/action`` | an action (JSON); needs the page's CSRF token in ``X-CSRF-Token`` |
| ``POST /login`` / ``POST /logout`` | a token in the form body (never in a URL) |

Every ``/api`` route needs the session cookie (HttpOnly, SameSite=Strict, Secure over
TLS), which the page (or the login) sets.
"""

from __future__ import annotations

import hmac
import html
import json
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import MsgqError, RpcError
from .service import VIEW_SECTIONS, ActionError, Console, Session

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "msgq_console"
#: Largest action body accepted (bytes): a form's params, not a bulk upload.
MAX_ACTION_BYTES = 1 << 20
#: Largest login form (bytes): a token is 43 characters.
MAX_LOGIN_BYTES = 4096
#: No inline script or style, nothing from elsewhere: the page's own files only.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
#: Seconds between keep-alive comments on an idle event stream (proxies close quiet ones).
KEEPALIVE = 15.0


def _headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }


def create_app(console: Console, *, secure: bool = False) -> Starlette:
    """The ASGI app of ``console``; ``secure``: served over TLS (cookies get Secure)."""

    def session_of(request: Request) -> Session | None:
        return console.session(request.cookies.get(COOKIE))

    def with_cookie(resp: Response, s: Session) -> Response:
        resp.set_cookie(COOKIE, s.sid, httponly=True, samesite="strict", secure=secure, path="/")
        return resp

    def page(name: str, **subst: str) -> str:
        text = (STATIC / name).read_text(encoding="utf-8")
        for k, v in subst.items():
            text = text.replace("{{" + k + "}}", html.escape(v, quote=True))
        return text

    async def index(request: Request) -> Response:
        s = session_of(request)
        if s is None:
            if console.login:
                return RedirectResponse("/login", status_code=303, headers=_headers())
            client = request.client
            where = f"{client.host}:{client.port}" if client else "?"
            s = console.new_session(f"local web viewer at {where}")
        resp = HTMLResponse(page("index.html", csrf=s.csrf, actor=s.actor), headers=_headers())
        return with_cookie(resp, s)

    async def login_form(request: Request) -> Response:
        return HTMLResponse(page("login.html", error=""), headers=_headers())

    async def login(request: Request) -> Response:
        # Parsed here (urlencoded, bounded): Starlette's form parser needs another package.
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BYTES:
                return HTMLResponse(
                    page("login.html", error="form too large"), status_code=413, headers=_headers()
                )
        try:
            fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
        except ValueError:
            return HTMLResponse(
                page("login.html", error="too many fields"), status_code=400, headers=_headers()
            )
        token = (fields.get("token") or [""])[0]
        if not token:
            return HTMLResponse(
                page("login.html", error="enter a token"), status_code=400, headers=_headers()
            )
        try:
            s = await console.log_in(token)
        except ActionError as exc:
            return HTMLResponse(
                page("login.html", error=str(exc)), status_code=403, headers=_headers()
            )
        return with_cookie(RedirectResponse("/", status_code=303, headers=_headers()), s)

    async def logout(request: Request) -> Response:
        s = session_of(request)
        if s is not None and _csrf_ok(request, s):
            console.end_session(s.sid)
        resp = RedirectResponse("/login" if console.login else "/", status_code=303)
        resp.delete_cookie(COOKIE, path="/")
        return resp

    def denied() -> Response:
        return JSONResponse(
            {"error": "no session: open the console's page first (or log in)"},
            status_code=401,
            headers=_headers(),
        )

    async def snapshot(request: Request) -> Response:
        if session_of(request) is None:
            return denied()
        # Every section, fresh: waits for the next snapshot when the console was idle.
        doc = await console.fresh_document(timeout=2 * console.interval + 5)
        return Response(doc, media_type="application/json", headers=_headers())

    async def events(request: Request) -> Response:
        if session_of(request) is None:
            return denied()
        view = request.query_params.get("view") or "all"
        if view not in VIEW_SECTIONS:
            return JSONResponse(
                {"error": f"unknown view {view!r}; views: {sorted(VIEW_SECTIONS)}"},
                400,
                headers=_headers(),
            )

        async def stream() -> AsyncIterator[str]:
            # The view's sections are polled while this stream is open (and only then).
            with console.watch(view) as sections:
                seq = -1
                while True:
                    with trio.move_on_after(KEEPALIVE) as idle:
                        seq, event, doc = await console.next_update(seq, sections)
                    if idle.cancelled_caught:
                        yield ": keep-alive\n\n"
                        continue
                    yield f"id: {seq}\nevent: {event}\ndata: {doc}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers=_headers())

    async def describe(request: Request) -> Response:
        if session_of(request) is None:
            return denied()
        target = request.query_params.get("target", "")
        if not target:
            return JSONResponse({"error": "target is required"}, 400, headers=_headers())
        try:
            rows = await console.describe(target)
        except (ActionError, MsgqError) as exc:
            return JSONResponse({"error": str(exc)}, 502, headers=_headers())
        return JSONResponse(rows, headers=_headers())

    async def action(request: Request) -> Response:
        s = session_of(request)
        if s is None:
            return denied()
        if not _csrf_ok(request, s):
            return JSONResponse(
                {"error": "missing or wrong CSRF token: reload the page"}, 403, headers=_headers()
            )
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_ACTION_BYTES:
                return JSONResponse(
                    {"error": f"action larger than {MAX_ACTION_BYTES} bytes"},
                    413,
                    headers=_headers(),
                )
        try:
            doc = json.loads(body)
        except ValueError as exc:
            return JSONResponse({"error": f"body is not JSON: {exc}"}, 400, headers=_headers())
        if not isinstance(doc, dict):
            return JSONResponse({"error": "body must be a JSON object"}, 400, headers=_headers())
        try:
            result = await console.act(s, doc)
        except ActionError as exc:
            return JSONResponse({"error": str(exc)}, 400, headers=_headers())
        except MsgqError as exc:
            return JSONResponse({"error": f"broker: {exc}"}, 502, headers=_headers())
        # default=str: a component's answer may hold bytes or other CBOR-only values.
        return Response(
            json.dumps(result, default=str), media_type="application/json", headers=_headers()
        )

    async def traffic(request: Request) -> Response:
        s = session_of(request)
        if s is None:
            return denied()
        q = request.query_params
        filters: dict[str, Any] = {}
        for key, name in (("kind", "kinds"), ("sender", "senders"), ("target", "targets")):
            values = [v for v in q.getlist(key) if v]
            if values:
                filters[name] = values
        if q.get("body") in ("json", "base64"):
            filters["body"] = q["body"]
        # The dump is started before the response begins: a refusal is an HTTP error.
        try:
            recv, scope = await console.open_traffic(filters)
        except ActionError as exc:
            return JSONResponse({"error": str(exc)}, 429, headers=_headers())
        except RpcError as exc:
            return JSONResponse({"error": f"{exc.code}: {exc.message}"}, 403, headers=_headers())
        except MsgqError as exc:
            return JSONResponse({"error": str(exc)}, 502, headers=_headers())

        async def stream() -> AsyncIterator[str]:
            try:
                yield ": started\n\n"
                while True:
                    with trio.move_on_after(KEEPALIVE) as idle:
                        doc = await recv.receive()
                    if idle.cancelled_caught:
                        yield ": keep-alive\n\n"
                        continue
                    yield f"event: traffic\ndata: {json.dumps(doc, default=str)}\n\n"
            except trio.EndOfChannel:
                return
            finally:
                # The viewer left (or the dump ended): stop the console's dump task.
                scope.cancel()
                recv.close()

        return StreamingResponse(stream(), media_type="text/event-stream", headers=_headers())

    routes = [
        Route("/", index),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/api/snapshot", snapshot),
        Route("/api/events", events),
        Route("/api/describe", describe),
        Route("/api/action", action, methods=["POST"]),
        Route("/api/traffic", traffic),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes)


def _csrf_ok(request: Request, s: Session) -> bool:
    sent = request.headers.get("x-csrf-token", "")
    return hmac.compare_digest(sent.encode(), s.csrf.encode())
