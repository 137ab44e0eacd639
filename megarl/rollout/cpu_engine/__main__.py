"""`python -m megarl.rollout.cpu_engine --model-path DIR --port N ...`: run one engine server."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import uvicorn

from megarl.rollout.cpu_engine.engine import EngineArgs
from megarl.rollout.cpu_engine.lora import check_lora_args
from megarl.rollout.cpu_engine.weights import DTYPES
from megarl.rollout.cpu_engine.http_server import build_app

logger = logging.getLogger("megarl.rollout.cpu_engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.cpu_engine", description=__doc__)
    parser.add_argument("--model-path", required=True, help="HF model dir (config.json + safetensors)")
    parser.add_argument("--tokenizer-path", default=None, help="tokenizer dir (default: the model dir, if it has one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on all but /health")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--max-batch", type=int, default=256, help="most sequences decoded together")
    parser.add_argument("--weight-version", default="default", help="initial weight_version")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without sampling_seed")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="weight dtype, as SGLang's --dtype ('auto': the checkpoint's torch_dtype); float32 by "
                             "default because bf16 matmuls on CPU are slow and round log-probs")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="allow /release_memory_occupation and /resume_memory_occupation (SGLang's flag)")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="resume released weights from a host copy (without it they come back undefined: NaN)")
    parser.add_argument("--health-check-timeout-s", type=float, default=20.0,
                        help="how long /health waits for its one-token generation (SGLANG_HEALTH_CHECK_TIMEOUT)")
    parser.add_argument("--weight-update-group-timeout-s", type=float, default=600.0,
                        help="how long joining or receiving from a weight-update group may take")
    parser.add_argument("--max-request-bytes", type=int, default=64 << 20,
                        help="largest request body; a larger one gets 413 before it is read")
    lora = parser.add_argument_group("LoRA serving (SGLang's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths)")
    lora.add_argument("--lora-paths", nargs="*", default=None,
                      help="adapters loaded at start: PATH | NAME=PATH | JSON {lora_name, lora_path, pinned}")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="largest rank a loaded adapter may have")
    lora.add_argument("--lora-target-modules", nargs="*", default=None,
                      help="modules adapters may target (q_proj ... down_proj, or all)")
    lora.add_argument("--max-loras-per-batch", type=int, default=8,
                      help="most adapters (the base model counting as one) in one running batch")
    lora.add_argument("--max-loaded-loras", type=int, default=None,
                      help="most adapters loaded; beyond it the least recently used unpinned one is unloaded")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    for problem in check_lora_args(enable_lora=args.enable_lora, lora_paths=args.lora_paths,
                                   max_lora_rank=args.max_lora_rank, lora_target_modules=args.lora_target_modules,
                                   max_loras_per_batch=args.max_loras_per_batch,
                                   max_loaded_loras=args.max_loaded_loras):
        parser.error(problem)
    if args.max_batch < 1 or args.threads < 1 or args.max_request_bytes < 1:
        parser.error("--max-batch, --threads and --max-request-bytes must be >= 1")
    if args.health_check_timeout_s <= 0 or args.weight_update_group_timeout_s <= 0:
        parser.error("--health-check-timeout-s and --weight-update-group-timeout-s must be > 0")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port: {args.port} is not a TCP port (0-65535)")
    model = Path(args.model_path)
    if not (model / "config.json").is_file():
        parser.error(f"--model-path: {model} holds no config.json (not an HF model directory)")
    return args


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = EngineArgs(**{key: value for key, value in vars(options).items() if key != "log_level"})
    if args.api_key is None:
        logger.warning("no --api-key: every endpoint, weight updates included, is open to any process that can "
                       "reach %s:%d", args.host, args.port)
    torch.set_num_threads(args.threads)
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
    # A weight operation can still sit in a rendezvous thread (bounded by its timeout, but not interruptible):
    # exit without joining it, so SIGTERM stops the server at once.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
