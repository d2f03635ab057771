"""What the contract doubles of the engines' FastAPI servers (``tests.vllm_double``,
``tests.sglang_double``) share: their routes served on a free loopback port, FastAPI's answers
to an unknown route (404 ``{"detail": "Not Found"}``) and to a known one with another method
(405), and the JSON object body FastAPI validates."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(routes: Sequence[tuple[str, str, Handler]], *, without: frozenset[str],
                middlewares: Sequence[Middleware] = ()) -> tuple[web.AppRunner, str]:
    """Serve ``routes`` (method, path, handler), less those whose path is in ``without`` (an
    engine that lacks them), on 127.0.0.1: the runner (``cleanup`` stops it) and the base URL.
    ``middlewares`` run inside the 404/405 mapping."""
    app = web.Application(middlewares=[_fastapi_errors, *middlewares])
    for method, path, handler in routes:
        if path not in without:
            app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@web.middleware
async def _fastapi_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


async def json_body(request: web.Request) -> dict[str, Any] | None:
    """The JSON object FastAPI would validate (None: missing or not an object)."""
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None
