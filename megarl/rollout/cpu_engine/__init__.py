"""A CPU inference server that speaks SGLang's HTTP protocol (0.5.23 fields and shapes).

SGLang does not run on CPU machines, so tests and CPU quickstarts run this
engine instead: a FastAPI + uvicorn process holding an HF causal LM in float32
that batches concurrent requests with a KV cache. Start it with
`python -m megarl.rollout.cpu_engine --model-path DIR --port N` (or
`megarl.rollout.server.start_cpu_engine`). It is as strict as SGLang 0.5.23
(see `http_server` and `engine`), so CPU tests fail where a GPU cluster would.
Modules: `args` (the command line, checked before torch loads), `schema`
(request validation), `generate_io` (requests <-> sequences/responses),
`sequence`, `sampler`, `scheduler` (the batch loop), `weights` (loading and
updates), `update_group` (receiving broadcasts), `memory` (memory release and
resume), `engine` (state behind the routes), `http_server` (the app and its
guard), `serving` (what the routes share), `update_gate` (the model-update
lock), `generate_routes`, `control_routes` and `weight_routes` (the routes).
The wire formats come from `megarl.rollout.weight_wire`.
"""
