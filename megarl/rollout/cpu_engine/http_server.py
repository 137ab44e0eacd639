"""The FastAPI app: SGLang's HTTP endpoints on top of `CpuEngine`.

The server listens before the model has loaded: `/health` answers 503 until
the engine is ready, and every other endpoint answers 503 meanwhile. With an API
key every endpoint except `/health*` needs `Authorization: Bearer <key>`
(SGLang's rule) and answers 401 otherwise. Bad requests get 400 with a message
naming the field: `{"error": {"message"}}` for `/generate` (SGLang's shape),
`{"success": false, "message"}` for weight updates.

As strict as SGLang 0.5.23:
- `/health` and `/health_generate` run a one-token generation and answer 200 once
  it finishes, else 503 after `--health-check-timeout-s` (SGLang's 20 s): while
  generation is paused (a weight update) they block, then fail.
- Weight operations (group joins, updates, memory release and resume) are served
  one at a time, in arrival order. A weight update that comes while generation is
  not paused first waits for the running requests to finish and holds new ones
  back (SGLang's model-update lock); while paused it runs at once.
- A failure that kills SGLang's scheduler (`engine.FatalError`) is answered with
  500 and then this process exits, as SGLang's server does.
Any other failing request leaves the server up.

The routes live in `generate_routes`, `control_routes`, `weight_routes` and `lora_routes`;
what they share (the state, body reading, reply shapes) in `serving`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from megarl.rollout.cpu_engine import control_routes, generate_routes, lora_routes, weight_routes
from megarl.rollout.cpu_engine.engine import CpuEngine, EngineArgs
from megarl.rollout.cpu_engine.serving import ServerState

logger = logging.getLogger(__name__)

ROUTERS = (generate_routes.router, control_routes.router, weight_routes.router, lora_routes.router)


def build_app(args: EngineArgs) -> FastAPI:
    """The app: it starts loading the model at start-up and serves the routes of `ROUTERS`."""
    state = ServerState(args)
    app = FastAPI(lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(_Guard, api_key=args.api_key, ready=lambda: state.ready)
    for router in ROUTERS:
        app.include_router(router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    loading = asyncio.create_task(_load_engine(state))
    yield
    loading.cancel()
    if state.engine is not None:
        await asyncio.to_thread(state.engine.shutdown)


async def _load_engine(state: ServerState) -> None:
    try:
        state.engine = await asyncio.to_thread(CpuEngine, state.args)
        logger.info("engine ready: %s", state.args.model_path)
    except Exception:  # noqa: BLE001 - report, then end the process
        logger.exception("failed to load the model from %s", state.args.model_path)
        # A server that can never become healthy must exit so its launcher
        # reports the failure (with this log) instead of waiting for a timeout.
        os._exit(1)


class _Guard:
    """ASGI middleware: API key check, then 503 until the engine is ready.

    A plain ASGI class rather than `@app.middleware("http")`, whose per-request
    overhead was a large share of a tiny model's generation time.
    """

    def __init__(self, app, *, api_key: str | None, ready: Callable[[], bool]):
        self._app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._ready = ready

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope["path"]
        if self._expected is not None and scope["method"] != "OPTIONS" and not path.startswith("/health"):
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(supplied, self._expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        if path != "/health" and not self._ready():
            await JSONResponse({"error": {"message": "server is starting"}}, status_code=503)(scope, receive, send)
            return
        await self._app(scope, receive, send)
