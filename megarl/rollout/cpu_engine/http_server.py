"""The FastAPI app: SGLang's HTTP endpoints on top of `CpuEngine`.

The server listens before the model has loaded: `/health` answers 503 until
the engine is ready, then 200 (empty body), and every other endpoint answers
503 meanwhile. With an API key every endpoint except `/health*` needs
`Authorization: Bearer <key>` (SGLang's rule) and answers 401 otherwise.
Bad requests get 400 with a message naming the field: `{"error": {"message"}}`
for `/generate` (SGLang's shape), `{"success": false, "message"}` for weight
updates. A failing request never takes the server down.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from megarl.rollout.cpu_engine.engine import CpuEngine, EngineArgs
from megarl.rollout.cpu_engine.generate_io import GenerateJob, build_job, output_dict
from megarl.rollout.cpu_engine.schema import (
    AbortRequestBody,
    BeginWeightUpdateBody,
    ContinueGenerationBody,
    DestroyWeightsUpdateGroupBody,
    EndWeightUpdateBody,
    GenerateBody,
    InitWeightsUpdateGroupBody,
    PauseGenerationBody,
    RequestError,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightVersionBody,
    parse_body,
)
from megarl.rollout.cpu_engine.sequence import SamplingSettings, Sequence

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


def build_app(args: EngineArgs) -> FastAPI:
    holder: dict[str, CpuEngine] = {}

    async def load_engine() -> None:
        try:
            holder["engine"] = await asyncio.to_thread(CpuEngine, args)
            logger.info("engine ready: %s", args.model_path)
        except Exception:  # noqa: BLE001 - report, then end the process
            logger.exception("failed to load the model from %s", args.model_path)
            # A server that can never become healthy must exit so its launcher
            # reports the failure (with this log) instead of waiting for a timeout.
            os._exit(1)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load_engine())
        yield
        loading.cancel()
        if "engine" in holder:
            await asyncio.to_thread(holder["engine"].shutdown)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, api_key=args.api_key, ready=lambda: "engine" in holder)

    def engine() -> CpuEngine:
        return holder["engine"]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if "engine" in holder else 503)

    @app.api_route("/health_generate", methods=["GET", "POST"])
    async def health_generate() -> Response:
        """200 once a one-token generation succeeds; 503 at once while generation is paused."""
        if engine().scheduler.paused:
            return Response(status_code=503)
        rid = f"health_generate_{uuid.uuid4().hex}"
        seq = Sequence(rid=rid, request_rid=rid, prompt_ids=[0],
                       sampling=SamplingSettings(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(_run(engine(), [seq]), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            engine().scheduler.abort(seq.rid, message="health_generate timed out")
            return Response(status_code=503)
        return Response(status_code=200 if seq.finish_reason["type"] != "abort" else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return engine().model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return engine().server_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if engine().flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = parse_body(GenerateBody, await _json(request))
            job = build_job(
                body,
                vocab_size=engine().vocab_size,
                context_length=engine().context_length,
                tokenizer=engine().tokenizer,
            )
        except RequestError as error:
            return JSONResponse({"error": {"message": "; ".join(error.problems)}}, status_code=400)
        if job.stream:
            return StreamingResponse(_stream(engine(), job), media_type="text/event-stream")
        await _run(engine(), job.seqs)
        outputs = [_output(engine(), job, seq) for seq in job.seqs]
        return JSONResponse(outputs if job.returns_list else outputs[0])

    def control_route(path: str, model: type):
        """Register `handler(body)` for POST `path`, its body validated as `model` (else 400 naming the field)."""

        def register(handler):
            async def endpoint(request: Request) -> Response:
                try:
                    body = parse_body(model, await _json(request))
                except RequestError as error:
                    return _result(False, "; ".join(error.problems))
                return await handler(body)

            app.add_api_route(path, endpoint, methods=["POST"])
            return handler

        return register

    @control_route("/abort_request", AbortRequestBody)
    async def abort_request(body: AbortRequestBody) -> Response:
        message = body.abort_message or "aborted by /abort_request"
        engine().scheduler.abort(body.rid or None, abort_all=body.abort_all, message=message)
        return Response(status_code=200)

    @control_route("/pause_generation", PauseGenerationBody)
    async def pause_generation(body: PauseGenerationBody) -> Response:
        await asyncio.to_thread(engine().scheduler.pause, body.mode)
        return _result(True, f"Generation paused ({body.mode}).")

    @control_route("/continue_generation", ContinueGenerationBody)
    async def continue_generation(body: ContinueGenerationBody) -> Response:
        engine().scheduler.resume()
        return _result(True, "Generation continued.")

    @control_route("/update_weight_version", UpdateWeightVersionBody)
    async def update_weight_version(body: UpdateWeightVersionBody) -> Response:
        await asyncio.to_thread(
            engine().update_weight_version, body.new_version, abort_all_requests=body.abort_all_requests
        )
        return _result(True, "Success", new_version=body.new_version)

    @control_route("/begin_weight_update", BeginWeightUpdateBody)
    async def begin_weight_update(body: BeginWeightUpdateBody) -> Response:
        return _result(*await asyncio.to_thread(engine().begin_weight_update, body.selector))

    @control_route("/end_weight_update", EndWeightUpdateBody)
    async def end_weight_update(body: EndWeightUpdateBody) -> Response:
        return _result(*await asyncio.to_thread(engine().end_weight_update))

    @control_route("/update_weights_from_tensor", UpdateWeightsFromTensorBody)
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorBody) -> Response:
        return _result(*await asyncio.to_thread(
            engine().update_weights_from_tensor,
            body.serialized_named_tensors,
            load_format=body.load_format,
            abort_all_requests=body.abort_all_requests,
            weight_version=body.weight_version,
        ))

    @control_route("/update_weights_from_disk", UpdateWeightsFromDiskBody)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskBody) -> Response:
        success, message = await asyncio.to_thread(
            engine().update_weights_from_disk,
            body.model_path,
            abort_all_requests=body.abort_all_requests,
            weight_version=body.weight_version,
        )
        return _result(success, message, num_paused_requests=0)

    @control_route("/init_weights_update_group", InitWeightsUpdateGroupBody)
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody) -> Response:
        return _result(*await asyncio.to_thread(
            engine().init_weights_update_group,
            master_address=body.master_address,
            master_port=body.master_port,
            rank_offset=body.rank_offset,
            world_size=body.world_size,
            group_name=body.group_name,
        ))

    @control_route("/update_weights_from_distributed", UpdateWeightsFromDistributedBody)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> Response:
        return _result(*await asyncio.to_thread(
            engine().update_weights_from_distributed,
            names=body.names,
            dtypes=body.dtypes,
            shapes=body.shapes,
            group_name=body.group_name,
            load_format=body.load_format,
            abort_all_requests=body.abort_all_requests,
            weight_version=body.weight_version,
        ))

    @app.get("/weights_checksum")
    async def weights_checksum() -> dict:
        """megarl's extension (SGLang has no such endpoint): per-tensor digests of the loaded weights."""
        return await asyncio.to_thread(engine().weights_checksum)

    @control_route("/destroy_weights_update_group", DestroyWeightsUpdateGroupBody)
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody) -> Response:
        return _result(*await asyncio.to_thread(engine().destroy_weights_update_group, body.group_name))

    return app


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


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as error:
        raise RequestError([f"body: invalid JSON: {error}"]) from None


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


def _output(engine: CpuEngine, job: GenerateJob, seq: Sequence, upto: int | None = None) -> dict:
    decode = engine.decode if engine.tokenizer is not None else None
    return output_dict(
        seq,
        decode=decode,
        text_in_logprobs=job.text_in_logprobs,
        current_weight_version=engine.weight_version,
        upto=upto,
    )


async def _run(engine: CpuEngine, seqs: list[Sequence]) -> None:
    """Submit sequences and wait until all have finished (aborting them if the caller goes away)."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in seqs]
    for seq, future in zip(seqs, futures):
        seq.on_finish = _finisher(engine, loop, future)
    engine.scheduler.submit(seqs)
    try:
        await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for seq in seqs:
            engine.scheduler.abort(seq.rid, message="client disconnected")
        raise


def _finisher(engine: CpuEngine, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    def on_finish(seq: Sequence) -> None:
        engine.stamp(seq)
        loop.call_soon_threadsafe(_resolve, future)

    return on_finish


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def _stream(engine: CpuEngine, job: GenerateJob) -> AsyncIterator[str]:
    """SSE: one `data: {...}` line per new token of any sequence (cumulative output), then `data: [DONE]`."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
    for index, seq in enumerate(job.seqs):
        seq.on_progress = lambda s, n, i=index: loop.call_soon_threadsafe(events.put_nowait, (i, n))

        def on_finish(s: Sequence, i: int = index) -> None:
            engine.stamp(s)
            loop.call_soon_threadsafe(events.put_nowait, (i, None))

        seq.on_finish = on_finish
    engine.scheduler.submit(job.seqs)
    remaining = len(job.seqs)
    try:
        while remaining:
            index, upto = await events.get()
            if upto is None:
                remaining -= 1
            chunk = _output(engine, job, job.seqs[index], upto)
            if job.returns_list:
                chunk["index"] = index
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for seq in job.seqs:
            if not seq.done:
                engine.scheduler.abort(seq.rid, message="client disconnected")
