"""The routes that generate: `/generate` (whole or streamed) and the one-token `/health_generate` probe.

`/health` is `/health_generate` unless the server's environment sets `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`
false: then it answers 200 without generating, as SGLang's does (the fleet starts servers so).
Generating while memory is released is an error (500, logged): SGLang would run a forward pass on freed
GPU memory.

Generation holds the model-update gate shared, so an update made while generation
is not paused waits for it (see `update_gate`). A non-streaming client that hangs up
has its sequences aborted; a streaming one, when its stream is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
import warnings
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from megarl.rollout.cpu_engine.engine import CpuEngine
from megarl.rollout.cpu_engine.generate_io import GenerateJob, build_job, output_dict
from megarl.rollout.cpu_engine.lora import LoraError
from megarl.rollout.cpu_engine.schema import GenerateBody, RequestError
from megarl.rollout.cpu_engine.sequence import SamplingSettings, Sequence
from megarl.rollout.cpu_engine.serving import read_body, state_of
from megarl.rollout.cpu_engine.update_gate import ModelUpdateGate

logger = logging.getLogger(__name__)
router = APIRouter()

DISCONNECT_POLL_S = 0.5
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def health_endpoint_generates() -> bool:
    """SGLang's `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` (`srt/environ.py`: an `EnvBool`, default True), read
    at each request as SGLang reads it: true/1/yes/y or false/0/no/n in any case; another value warns and
    counts as the default."""
    value = os.environ.get(HEALTH_GENERATION_ENV)
    if value is None:
        return True
    value = value.lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    warnings.warn(f'Invalid value for {HEALTH_GENERATION_ENV}: "{value}" is not a valid boolean value, '
                  f'using default "True"')
    return True


@router.get("/health")
@router.get("/health_generate")
async def health(request: Request) -> Response:
    """200 once a one-token generation finishes; 503 while starting or after the timeout; 500 (and an error in
    the log) on released memory. `/health` with health generation off: 200 at once, nothing generated."""
    state = state_of(request)
    engine = state.engine
    if engine is None:
        return Response(status_code=503)
    if request.url.path == "/health" and not health_endpoint_generates():
        return Response(status_code=200)
    if engine.memory.released:
        return _released(engine, request.url.path)
    rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
    seq = Sequence(rid=rid, request_rid=rid, prompt_ids=[0],
                   sampling=SamplingSettings(max_new_tokens=1, temperature=0.0))

    async def one_token() -> None:
        async with state.gate.shared():
            await _run(engine, [seq])

    try:
        await asyncio.wait_for(one_token(), state.args.health_check_timeout_s)
    except asyncio.TimeoutError:
        engine.scheduler.abort(seq.rid, message="health check timed out")
        return Response(status_code=503)
    return Response(status_code=200 if seq.finish_reason["type"] != "abort" else 503)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    state = state_of(request)
    engine = state.engine
    if engine.memory.released:
        return _released(engine, "/generate")
    refused = engine.memory.generation_refusal()
    if refused:
        return JSONResponse({"error": {"message": refused}}, status_code=400)
    try:
        body = await read_body(request, GenerateBody, state.args.max_request_bytes)
        # Tokenizing a text is real work: off the event loop, so /health and the control calls stay live.
        job = await asyncio.to_thread(
            build_job,
            body,
            vocab_size=engine.vocab_size,
            context_length=engine.context_length,
            tokenizer=engine.tokenizer,
            limits=state.limits,
            pool=engine.kv_pool,
        )
        adapters = _acquire_adapters(engine, job)
    except RequestError as error:
        return JSONResponse({"error": {"message": "; ".join(error.problems)}}, status_code=error.status)
    if job.stream:
        return StreamingResponse(_stream(engine, job, state.gate, adapters), media_type="text/event-stream")
    try:
        async with state.gate.shared():
            if not await _run(engine, job.seqs, disconnected=request.is_disconnected):
                return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    finally:
        _release_adapters(engine, adapters)
    outputs = [_output(engine, job, seq) for seq in job.seqs]
    return JSONResponse(outputs if job.returns_list else outputs[0])


def _acquire_adapters(engine: CpuEngine, job: GenerateJob) -> list:
    """The LoRA adapters the job's sequences name, counted in use until released (an unloading adapter waits
    for them); RequestError when LoRA is off or a name is not loaded, as SGLang refuses the request."""
    if all(name is None for name in job.lora_names):
        return []
    if engine.lora is None:
        raise RequestError(["lora_path: LoRA is not enabled. Please set `--enable-lora` to enable LoRA."])
    try:
        adapters = engine.lora.acquire(job.lora_names)
    except LoraError as error:
        raise RequestError([str(error)]) from None
    for seq, adapter in zip(job.seqs, adapters):
        seq.adapter = adapter
    return adapters


def _release_adapters(engine: CpuEngine, adapters: list) -> None:
    if adapters:
        engine.lora.release(adapters)


def _released(engine: CpuEngine, path: str) -> Response:
    """A generation asked for while memory is released: SGLang would run its forward pass on freed GPU
    memory (its /health_generate, and /health with health generation on, generate one token), so this is an
    error in the reply and in the log, loud enough for a test to catch any prober (liveness belongs on
    /model_info)."""
    tags = sorted(engine.memory.released)
    message = (f"{path} ran a generation on released memory (tags {tags}): SGLang would run a forward pass on "
               f"freed GPU memory; resume the memory first, and probe liveness with /model_info")
    logger.error(message)
    return JSONResponse({"error": {"message": message}}, status_code=500)


def _output(engine: CpuEngine, job: GenerateJob, seq: Sequence, upto: int | None = None) -> dict:
    decode = engine.decode if engine.tokenizer is not None else None
    return output_dict(
        seq,
        decode=decode,
        text_in_logprobs=job.text_in_logprobs,
        current_weight_version=engine.weight_version,
        upto=upto,
    )


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


async def _stream(engine: CpuEngine, job: GenerateJob, gate: ModelUpdateGate, adapters: list) -> AsyncIterator[str]:
    """SSE: one `data: {...}` line per new token of any sequence (cumulative output), then `data: [DONE]`."""
    try:
        async with gate.shared():
            async for chunk in _stream_chunks(engine, job):
                yield chunk
    finally:
        _release_adapters(engine, adapters)


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
