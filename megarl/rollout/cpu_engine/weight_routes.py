"""The routes that change or read the weights: update sessions, the three update paths, update groups,
weight versions, memory release and resume, and the weight checker.

Each blocking engine call runs on a worker thread through `ServerState.weight_op`,
which serves weight operations one at a time as SGLang does (see `http_server`).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from megarl.rollout.cpu_engine.schema import (
    BeginWeightUpdateBody,
    CheckWeightsBody,
    DestroyWeightsUpdateGroupBody,
    EndWeightUpdateBody,
    InitWeightsUpdateGroupBody,
    ReleaseMemoryOccupationBody,
    ResumeMemoryOccupationBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightVersionBody,
    RequestError,
)
from megarl.rollout.cpu_engine.serving import control_route, engine_of, read_body, result, state_of

router = APIRouter()


@control_route(router, "/release_memory_occupation", ReleaseMemoryOccupationBody, methods=("GET", "POST"))
async def release_memory_occupation(request: Request, body: ReleaseMemoryOccupationBody) -> Response:
    return await state_of(request).weight_op(engine_of(request).release_memory_occupation, body.tags)


@control_route(router, "/resume_memory_occupation", ResumeMemoryOccupationBody, methods=("GET", "POST"))
async def resume_memory_occupation(request: Request, body: ResumeMemoryOccupationBody) -> Response:
    return await state_of(request).weight_op(engine_of(request).resume_memory_occupation, body.tags)


@control_route(router, "/update_weight_version", UpdateWeightVersionBody)
async def update_weight_version(request: Request, body: UpdateWeightVersionBody) -> Response:
    await asyncio.to_thread(
        engine_of(request).update_weight_version, body.new_version, abort_all_requests=body.abort_all_requests
    )
    return result(True, "Success", new_version=body.new_version)


@control_route(router, "/begin_weight_update", BeginWeightUpdateBody)
async def begin_weight_update(request: Request, body: BeginWeightUpdateBody) -> Response:
    return result(*await asyncio.to_thread(engine_of(request).begin_weight_update, body.selector))


@control_route(router, "/end_weight_update", EndWeightUpdateBody)
async def end_weight_update(request: Request, body: EndWeightUpdateBody) -> Response:
    return result(*await asyncio.to_thread(engine_of(request).end_weight_update))


@control_route(router, "/update_weights_from_tensor", UpdateWeightsFromTensorBody)
async def update_weights_from_tensor(request: Request, body: UpdateWeightsFromTensorBody) -> Response:
    return await state_of(request).weight_op(
        engine_of(request).update_weights_from_tensor,
        body.serialized_named_tensors,
        update=True,
        load_format=body.load_format,
        flush_cache=body.flush_cache,
        abort_all_requests=body.abort_all_requests,
        weight_version=body.weight_version,
    )


@control_route(router, "/update_weights_from_disk", UpdateWeightsFromDiskBody)
async def update_weights_from_disk(request: Request, body: UpdateWeightsFromDiskBody) -> Response:
    reply = await state_of(request).weight_op(
        engine_of(request).update_weights_from_disk,
        body.model_path,
        update=True,
        flush_cache=body.flush_cache,
        abort_all_requests=body.abort_all_requests,
        weight_version=body.weight_version,
    )
    if reply.status_code == 500:
        return reply
    content = json.loads(reply.body)
    return result(content["success"], content["message"], num_paused_requests=0)


@control_route(router, "/init_weights_update_group", InitWeightsUpdateGroupBody)
async def init_weights_update_group(request: Request, body: InitWeightsUpdateGroupBody) -> Response:
    return await state_of(request).weight_op(
        engine_of(request).init_weights_update_group,
        master_address=body.master_address,
        master_port=body.master_port,
        rank_offset=body.rank_offset,
        world_size=body.world_size,
        group_name=body.group_name,
    )


@control_route(router, "/update_weights_from_distributed", UpdateWeightsFromDistributedBody)
async def update_weights_from_distributed(request: Request, body: UpdateWeightsFromDistributedBody) -> Response:
    return await state_of(request).weight_op(
        engine_of(request).update_weights_from_distributed, update=True,
        names=body.names,
        dtypes=body.dtypes,
        shapes=body.shapes,
        group_name=body.group_name,
        load_format=body.load_format,
        flush_cache=body.flush_cache,
        abort_all_requests=body.abort_all_requests,
        weight_version=body.weight_version,
    )


@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(request: Request) -> Response:
    """SGLang's weight checker; GET or an empty body runs its default action, `checksum`."""
    try:
        body = await read_body(request, CheckWeightsBody, state_of(request).args.max_request_bytes)
    except RequestError as error:
        return result(False, "; ".join(error.problems), status=error.status)
    success, message, extra = await asyncio.to_thread(engine_of(request).check_weights, body.action,
                                                    body.skip_tensor_list)
    return result(success, message, **extra)


@control_route(router, "/destroy_weights_update_group", DestroyWeightsUpdateGroupBody)
async def destroy_weights_update_group(request: Request, body: DestroyWeightsUpdateGroupBody) -> Response:
    return await state_of(request).weight_op(engine_of(request).destroy_weights_update_group, body.group_name)
