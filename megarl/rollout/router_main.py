"""`python -m megarl.rollout.router_main ARGS...`: sglang-router, with its API key taken from the environment.

sglang-router (0.3.2) reads its key only from `--api-key`, and a command line is readable by every local
user (`/proc/<pid>/cmdline`); a process's environment only by its owner. This runs the router's own
launcher on the other arguments, unchanged, with the key of `ROUTER_API_KEY_ENV` (removed from the
environment once read).
"""

from __future__ import annotations

import os
import sys

ROUTER_API_KEY_ENV = "MEGARL_ROUTER_API_KEY"


def main(argv: list[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    router_args = parse_router_args(sys.argv[1:] if argv is None else argv)
    router_args.api_key = os.environ.pop(ROUTER_API_KEY_ENV, None) or None
    launch_router(router_args)


if __name__ == "__main__":
    main()
