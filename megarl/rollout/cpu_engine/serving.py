"""What every route shares: the server's state, reading a body, the reply shapes, and serving weight operations.

`ServerState` lives on `app.state.server`; a handler reaches it with `state_of(request)`.
`control_route(router, path, model)` registers a POST handler that receives its body
validated as `model` (400 naming the field otherwise, in the `{"success", "message"}`
shape of SGLang's control replies).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from megarl.rollout.cpu_engine.engine import CpuEngine, EngineArgs, FatalError
from megarl.rollout.cpu_engine.generate_io import Limits
from megarl.rollout.cpu_engine.schema import RequestError, parse_body
from megarl.rollout.cpu_engine.update_gate import ModelUpdateGate

logger = logging.getLogger(__name__)

EXIT_DELAY_S = 0.2  # after a fatal error: long enough to send the 500, as SGLang's dying server may not


@dataclass
class ServerState:
    """The engine (None until it has loaded) and the locks the HTTP layer serves it under."""

    args: EngineArgs
    engine: CpuEngine | None = None
    gate: ModelUpdateGate = field(default_factory=ModelUpdateGate)
    # FIFO: weight operations are served one at a time, in arrival order.
    weight_ops: asyncio.Lock = field(default_factory=asyncio.Lock)
    # LoRA adapter loads and unloads, one at a time (SGLang's lora_update_lock)
    lora_ops: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def limits(self) -> Limits:
        args = self.args
        return Limits(max_sequences=args.max_sequences, max_reply_entries=args.max_reply_entries,
                      honour_seed=args.enable_deterministic_inference)

    async def weight_op(self, action: Callable[..., tuple[bool, str]], *call_args: Any, update: bool = False,
                        **call_kwargs: Any) -> JSONResponse:
        """Run a blocking engine call as SGLang serves weight operations; its (success, message) as JSON.

        `update`: a weight update, which (unless generation is paused) waits for the model-update gate;
        SGLang takes that lock for updates only, not for group joins or memory release."""
        timeout_s = self.args.weight_update_group_timeout_s
        try:
            # Bounded: a weight operation stuck in a rendezvous must not queue the others for ever.
            await asyncio.wait_for(self.weight_ops.acquire(), timeout_s)
        except asyncio.TimeoutError:
            return result(False, f"another weight operation has held the server for {timeout_s:.0f} s; "
                                 f"try again later", status=503)
        engine = self.engine
        try:
            exclusive = self.gate.exclusive() if update and not engine.scheduler.paused else nullcontext()
            async with exclusive:
                engine.weight_op_in_progress = action.__name__
                try:
                    success, message = await asyncio.to_thread(action, *call_args, **call_kwargs)
                except FatalError as error:
                    return die(str(error))
                finally:
                    engine.weight_op_in_progress = None
        finally:
            self.weight_ops.release()
        return result(success, message)


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def engine_of(request: Request) -> CpuEngine:
    """The loaded engine (the guard answers 503 to every route but /health until there is one)."""
    return request.app.state.server.engine


async def read_body(request: Request, model: type, limit: int) -> Any:
    """The body validated as `model` (RequestError naming the field): read no further than `limit` bytes (413
    beyond it, before it is parsed), and decoded and validated off the event loop when large, so one big
    request never holds up /health or /model_info."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError([f"body: {declared} bytes, more than the server's limit of {limit}"], status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError([f"body: more than the server's limit of {limit} bytes"], status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(_decoded, raw, model)
    return _decoded(raw, model)


INLINE_PARSE_BYTES = 64 << 10  # larger bodies are parsed on a worker thread


def _decoded(raw: bytes, model: type) -> Any:
    if not raw.strip():
        return parse_body(model, {})
    try:
        payload = json.loads(raw)
    except ValueError as error:
        raise RequestError([f"body: invalid JSON: {error}"]) from None
    except RecursionError:
        raise RequestError(["body: JSON nested too deeply"]) from None
    return parse_body(model, payload)


def result(success: bool, message: str, *, status: int | None = None, **extra: Any) -> JSONResponse:
    """SGLang's control reply: `{success, message, ...}`, 200 on success, else 400 unless `status` says."""
    return JSONResponse({"success": success, "message": message, **extra},
                        status_code=status or (200 if success else 400))


def die(message: str) -> JSONResponse:
    """Answer a fatal error, then end the process, as SGLang's server does when its scheduler dies."""
    logger.critical("fatal (SGLang's scheduler would die here; this server exits): %s", message)
    asyncio.get_running_loop().call_later(EXIT_DELAY_S, os._exit, 1)
    return JSONResponse({"success": False, "message": f"fatal, the server exits: {message}"}, status_code=500)


ControlHandler = Callable[[Request, Any], Awaitable[Response]]


def control_route(router: APIRouter, path: str, model: type, *, methods: tuple[str, ...] = ("POST",)
                  ) -> Callable[[ControlHandler], ControlHandler]:
    """Register `handler(request, body)` for `path` on `router` (SGLang's `methods`), its body validated as
    `model`."""

    def register(handler: ControlHandler) -> ControlHandler:
        async def endpoint(request: Request) -> Response:
            try:
                body = await read_body(request, model, state_of(request).args.max_request_bytes)
            except RequestError as error:
                return result(False, "; ".join(error.problems), status=error.status)
            return await handler(request, body)

        endpoint.__name__ = handler.__name__
        router.add_api_route(path, endpoint, methods=list(methods))
        return handler

    return register
