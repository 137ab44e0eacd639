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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import uuid
from contextlib import asynccontextmanager, nullcontext
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from megarl.rollout.cpu_engine.engine import CpuEngine, EngineArgs, FatalError
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
    ReleaseMemoryOccupationBody,
    RequestError,
    ResumeMemoryOccupationBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightVersionBody,
    parse_body,
)
from megarl.rollout.cpu_engine.sequence import SamplingSettings, Sequence

logger = logging.getLogger(__name__)

EXIT_DELAY_S = 0.2  # after a fatal error: long enough to send the 500, as SGLang's dying server may not


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

    gate = _ModelUpdateGate()
    weight_ops = asyncio.Lock()  # FIFO: weight operations are served one at a time, in arrival order

    async def weight_op(action, *call_args, update: bool = False, **call_kwargs) -> JSONResponse:
        """Run a blocking engine call as SGLang serves weight operations; its (success, message) as JSON.

        `update`: a weight update, which (unless generation is paused) waits for the model-update gate;
        SGLang takes that lock for updates only, not for group joins or memory release."""
        try:
            # Bounded: a weight operation stuck in a rendezvous must not queue the others for ever.
            await asyncio.wait_for(weight_ops.acquire(), args.weight_update_group_timeout_s)
        except asyncio.TimeoutError:
            return _result(False, f"another weight operation has held the server for "
                                  f"{args.weight_update_group_timeout_s:.0f} s; try again later", status=503)
        try:
            exclusive = gate.exclusive() if update and not engine().scheduler.paused else nullcontext()
            async with exclusive:
                engine().weight_op_in_progress = action.__name__
                try:
                    success, message = await asyncio.to_thread(action, *call_args, **call_kwargs)
                except FatalError as error:
                    return _die(str(error))
                finally:
                    engine().weight_op_in_progress = None
        finally:
            weight_ops.release()
        return _result(success, message)

    @app.api_route("/health", methods=["GET"])
    @app.api_route("/health_generate", methods=["GET", "POST"])
    async def health() -> Response:
        """200 once a one-token generation finishes; 503 while starting, released, or after the timeout."""
        if "engine" not in holder or engine().memory.released:
            return Response(status_code=503)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        seq = Sequence(rid=rid, request_rid=rid, prompt_ids=[0],
                       sampling=SamplingSettings(max_new_tokens=1, temperature=0.0))

        async def one_token() -> None:
            async with gate.shared():
                await _run(engine(), [seq])

        try:
            await asyncio.wait_for(one_token(), args.health_check_timeout_s)
        except asyncio.TimeoutError:
            engine().scheduler.abort(seq.rid, message="health check timed out")
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
        refused = engine().memory.generation_refusal()
        if refused:
            return JSONResponse({"error": {"message": refused}}, status_code=400)
        try:
            body = parse_body(GenerateBody, await _json(request, args.max_request_bytes))
            # Tokenizing a text is real work: off the event loop, so /health and the control calls stay live.
            job = await asyncio.to_thread(
                build_job,
                body,
                vocab_size=engine().vocab_size,
                context_length=engine().context_length,
                tokenizer=engine().tokenizer,
            )
        except RequestError as error:
            return JSONResponse({"error": {"message": "; ".join(error.problems)}}, status_code=error.status)
        if job.stream:
            return StreamingResponse(_stream(engine(), job, gate), media_type="text/event-stream")
        async with gate.shared():
            if not await _run(engine(), job.seqs, disconnected=request.is_disconnected):
                return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        outputs = [_output(engine(), job, seq) for seq in job.seqs]
        return JSONResponse(outputs if job.returns_list else outputs[0])

    def control_route(path: str, model: type):
        """Register `handler(body)` for POST `path`, its body validated as `model` (else 400 naming the field)."""

        def register(handler):
            async def endpoint(request: Request) -> Response:
                try:
                    body = parse_body(model, await _json(request, args.max_request_bytes))
                except RequestError as error:
                    return _result(False, "; ".join(error.problems), status=error.status)
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

    @control_route("/release_memory_occupation", ReleaseMemoryOccupationBody)
    async def release_memory_occupation(body: ReleaseMemoryOccupationBody) -> Response:
        return await weight_op(engine().release_memory_occupation, body.tags)

    @control_route("/resume_memory_occupation", ResumeMemoryOccupationBody)
    async def resume_memory_occupation(body: ResumeMemoryOccupationBody) -> Response:
        return await weight_op(engine().resume_memory_occupation, body.tags)

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
        return await weight_op(
            engine().update_weights_from_tensor,
            body.serialized_named_tensors,
            update=True,
            load_format=body.load_format,
            flush_cache=body.flush_cache,
            abort_all_requests=body.abort_all_requests,
            weight_version=body.weight_version,
        )

    @control_route("/update_weights_from_disk", UpdateWeightsFromDiskBody)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskBody) -> Response:
        reply = await weight_op(
            engine().update_weights_from_disk,
            body.model_path,
            update=True,
            flush_cache=body.flush_cache,
            abort_all_requests=body.abort_all_requests,
            weight_version=body.weight_version,
        )
        if reply.status_code == 500:
            return reply
        content = json.loads(reply.body)
        return _result(content["success"], content["message"], num_paused_requests=0)

    @control_route("/init_weights_update_group", InitWeightsUpdateGroupBody)
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody) -> Response:
        return await weight_op(
            engine().init_weights_update_group,
            master_address=body.master_address,
            master_port=body.master_port,
            rank_offset=body.rank_offset,
            world_size=body.world_size,
            group_name=body.group_name,
        )

    @control_route("/update_weights_from_distributed", UpdateWeightsFromDistributedBody)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> Response:
        return await weight_op(
            engine().update_weights_from_distributed, update=True,
            names=body.names,
            dtypes=body.dtypes,
            shapes=body.shapes,
            group_name=body.group_name,
            load_format=body.load_format,
            flush_cache=body.flush_cache,
            abort_all_requests=body.abort_all_requests,
            weight_version=body.weight_version,
        )

    @app.get("/weights_checksum")
    async def weights_checksum() -> Response:
        """megarl's extension (SGLang has no such endpoint): per-tensor digests of the loaded weights."""
        success, reply = await asyncio.to_thread(engine().weights_checksum)
        return JSONResponse(reply) if success else _result(False, reply)

    @control_route("/destroy_weights_update_group", DestroyWeightsUpdateGroupBody)
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody) -> Response:
        return await weight_op(engine().destroy_weights_update_group, body.group_name)

    return app


class _ModelUpdateGate:
    """SGLang's model-update lock: generation holds it shared; an update made while generation is
    not paused holds it exclusively, so it waits for running requests and holds new ones back."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


def _die(message: str) -> JSONResponse:
    """Answer a fatal error, then end the process, as SGLang's server does when its scheduler dies."""
    logger.critical("fatal (SGLang's scheduler would die here; this server exits): %s", message)
    asyncio.get_running_loop().call_later(EXIT_DELAY_S, os._exit, 1)
    return JSONResponse({"success": False, "message": f"fatal, the server exits: {message}"}, status_code=500)


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


async def _json(request: Request, limit: int) -> Any:
    """The decoded body, read no further than `limit` bytes (413 beyond it, before it is parsed)."""
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
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as error:
        raise RequestError([f"body: invalid JSON: {error}"]) from None
    except RecursionError:
        raise RequestError(["body: JSON nested too deeply"]) from None


def _result(success: bool, message: str, *, status: int | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra},
                        status_code=status or (200 if success else 400))


def _output(engine: CpuEngine, job: GenerateJob, seq: Sequence, upto: int | None = None) -> dict:
    decode = engine.decode if engine.tokenizer is not None else None
    return output_dict(
        seq,
        decode=decode,
        text_in_logprobs=job.text_in_logprobs,
        current_weight_version=engine.weight_version,
        upto=upto,
    )


DISCONNECT_POLL_S = 0.5


async def _run(engine: CpuEngine, seqs: list[Sequence], *,
               disconnected: Callable[[], Any] | None = None) -> bool:
    """Submit sequences and wait until all have finished (True); abort them if the caller goes away (False, or
    cancelled): a non-streaming client that hung up is noticed only by asking `disconnected()`."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in seqs]
    for seq, future in zip(seqs, futures):
        seq.on_finish = _finisher(engine, loop, future)
    engine.scheduler.submit(seqs)
    finished = asyncio.gather(*futures)
    try:
        while not (await asyncio.wait([finished], timeout=DISCONNECT_POLL_S))[0]:
            if disconnected is not None and await disconnected():
                _abort(engine, seqs)
                return False
        return True
    except asyncio.CancelledError:
        _abort(engine, seqs)
        raise


def _abort(engine: CpuEngine, seqs: list[Sequence]) -> None:
    for seq in seqs:
        engine.scheduler.abort(seq.rid, message="client disconnected")


def _finisher(engine: CpuEngine, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    def on_finish(seq: Sequence) -> None:
        engine.stamp(seq)
        loop.call_soon_threadsafe(_resolve, future)

    return on_finish


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def _stream(engine: CpuEngine, job: GenerateJob, gate: _ModelUpdateGate) -> AsyncIterator[str]:
    """SSE: one `data: {...}` line per new token of any sequence (cumulative output), then `data: [DONE]`."""
    async with gate.shared():
        async for chunk in _stream_chunks(engine, job):
            yield chunk


async def _stream_chunks(engine: CpuEngine, job: GenerateJob) -> AsyncIterator[str]:
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
