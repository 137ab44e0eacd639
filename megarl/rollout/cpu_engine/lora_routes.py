"""The LoRA adapter routes: `/load_lora_adapter`, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter`.

Replies have the shape of SGLang's `LoRAUpdateOutput`: `{success, error_message,
loaded_adapters}` ({name: path}, `__tensor__` for adapters loaded from tensors), 200 on
success and 400 otherwise. Adapter loads and unloads are served one at a time, as SGLang's
`lora_update_lock` serves them, and apart from weight updates; an unload returns once no
request uses the adapter any more. A tensor payload SGLang's scheduler would die of (an
unsafe pickle, no entry for TP rank 0) ends the server as a weight update's does.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from megarl.rollout.cpu_engine.engine import FatalError
from megarl.rollout.cpu_engine.schema import LoadLoRAAdapterBody, LoadLoRAAdapterFromTensorsBody, UnloadLoRAAdapterBody
from megarl.rollout.cpu_engine.serving import control_route, die, engine_of, state_of

router = APIRouter()


async def _lora_op(request: Request, call) -> Response:
    engine = engine_of(request)
    async with state_of(request).lora_ops:
        try:
            success, error, loaded = await asyncio.to_thread(engine.lora_operation, call)
        except FatalError as fatal:
            return die(str(fatal))
    return JSONResponse({"success": success, "error_message": error, "loaded_adapters": loaded},
                        status_code=200 if success else 400)


@control_route(router, "/load_lora_adapter", LoadLoRAAdapterBody)
async def load_lora_adapter(request: Request, body: LoadLoRAAdapterBody) -> Response:
    return await _lora_op(request, lambda lora: lora.load_dir(body.lora_name, body.lora_path, pinned=body.pinned))


@control_route(router, "/load_lora_adapter_from_tensors", LoadLoRAAdapterFromTensorsBody)
async def load_lora_adapter_from_tensors(request: Request, body: LoadLoRAAdapterFromTensorsBody) -> Response:
    engine = engine_of(request)

    def load(lora):
        tensors = engine.lora_tensors(body.serialized_named_tensors, body.load_format)
        return lora.load_tensors(body.lora_name, body.config_dict, tensors, pinned=body.pinned,
                                 expected_checksums=body.expected_checksums)

    return await _lora_op(request, load)


@control_route(router, "/unload_lora_adapter", UnloadLoRAAdapterBody)
async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapterBody) -> Response:
    return await _lora_op(request, lambda lora: lora.unload(body.lora_name))
