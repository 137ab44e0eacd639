"""Quiet by default: the third-party warnings and progress bars that tell a megarl user nothing.

`quiet_third_parties()` runs in the CLI's process and, through `megarl.engines`, in
every engine worker. It hides, by exact message or logger, only what is known to be
noise on a healthy run: torch.distributed.checkpoint's FutureWarnings that megatron's
dist_checkpointing triggers on every save and load, Ray's notice on every start that
token authentication is on, and HF's per-file progress bars ("Writing model shards",
"Loading weights"). `hide_ray_backend_notices()`, once the driver has joined Ray, drops
from what Ray forwards of its own processes' logs the error that its metrics agent is
missing: Ray installed without its dashboard extras (`ray[default]`, which megarl does
not use) has none, and its GCS, raylet and workers each say so ~25 s into every run.
megarl's own warnings, and any other warning or error, still show.
`megarl --verbose` sets `MEGARL_VERBOSE=1`, which Ray workers inherit, and everything
shows again.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

VERBOSE_ENV = "MEGARL_VERBOSE"
# FutureWarnings of torch.distributed.checkpoint raised inside megatron's dist_checkpointing.
KNOWN_FUTURE_WARNINGS = (
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    r"`load_state_dict` is deprecated",
    r"`save_state_dict` is deprecated",
)
# Ray's loggers whose every message is a notice about Ray itself (token authentication on or off).
RAY_NOTICE_LOGGERS = ("ray._private.authentication.authentication_token_setup",)
# Lines Ray's GCS, raylet and core workers log when no metrics agent answers (no `ray[default]` installed).
RAY_BACKEND_NOTICE = re.compile(r"Failed to establish connection to the (event\+)?metrics exporter agent")
# The handler Ray registers to print what it forwards to the driver (`ray._private.worker.connect`).
_RAY_PRINT_HANDLER = "ray_print_logs"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_third_parties() -> None:
    """Hide the known third-party noise in this process (nothing with MEGARL_VERBOSE=1)."""
    if verbose():
        return
    for message in KNOWN_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    # huggingface_hub reads it when it is first imported; transformers' bars follow it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in RAY_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def hide_ray_backend_notices() -> None:
    """Drop `RAY_BACKEND_NOTICE` lines from what Ray prints of its processes' logs in this driver (call after
    `ray.init`; nothing with MEGARL_VERBOSE=1). Ray has no setting for it: its printing handler is wrapped."""
    if verbose():
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # a Ray that moved it: its notices show, nothing else changes
        return
    with dispatcher._lock:
        dispatcher.handlers = [(name, _without_backend_notices(handler) if name == _RAY_PRINT_HANDLER else handler)
                               for name, handler in dispatcher.handlers]


def _without_backend_notices(handler):
    if getattr(handler, "hides_backend_notices", False):
        return handler

    def handle(data: dict) -> None:
        lines = [line for line in data.get("lines", ()) if not RAY_BACKEND_NOTICE.search(line)]
        if lines:
            handler({**data, "lines": lines})

    handle.hides_backend_notices = True
    return handle
