"""`python -m megarl.rollout.cpu_engine --model-path DIR --port N ...`: run one engine server.

The arguments are parsed and checked first (`args`: one line and exit status 2 for a bad one); only then
are torch, transformers and the server imported, which takes seconds.
"""

from __future__ import annotations

import logging
import os

from megarl.rollout.cpu_engine.args import parse_args

logger = logging.getLogger("megarl.rollout.cpu_engine")


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import uvicorn

    from megarl.rollout.cpu_engine.engine import EngineArgs
    from megarl.rollout.cpu_engine.http_server import build_app

    args = EngineArgs(**{key: value for key, value in vars(options).items() if key not in ("log_level", "config")})
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
