"""The routes that inspect or steer serving: model and server info, cache flush, abort, pause and continue."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from megarl.rollout.cpu_engine.schema import AbortRequestBody, ContinueGenerationBody, PauseGenerationBody
from megarl.rollout.cpu_engine.serving import control_route, engine_of, result

router = APIRouter()


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict:
    return engine_of(request).model_info()


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict:
    return engine_of(request).server_info()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    if engine_of(request).flush_cache():
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)


@control_route(router, "/abort_request", AbortRequestBody)
async def abort_request(request: Request, body: AbortRequestBody) -> Response:
    message = body.abort_message or "aborted by /abort_request"
    engine_of(request).scheduler.abort(body.rid or None, abort_all=body.abort_all, message=message)
    return Response(status_code=200)


@control_route(router, "/pause_generation", PauseGenerationBody)
async def pause_generation(request: Request, body: PauseGenerationBody) -> Response:
    await asyncio.to_thread(engine_of(request).scheduler.pause, body.mode)
    return result(True, f"Generation paused ({body.mode}).")


@control_route(router, "/continue_generation", ContinueGenerationBody)
async def continue_generation(request: Request, body: ContinueGenerationBody) -> Response:
    engine_of(request).scheduler.resume()
    return result(True, "Generation continued.")
