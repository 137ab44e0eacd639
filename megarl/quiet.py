"""Quiet by default: the third-party warnings and progress bars that tell a megarl user nothing.

`quiet_third_parties()` runs in the CLI's process and, through `megarl.engines`, in
every engine worker. It hides, by exact message or logger, only what is known to be
noise on a healthy run: torch.distributed.checkpoint's FutureWarnings that megatron's
dist_checkpointing triggers on every save and load, Ray's notice on every start that
token authentication is on, and HF's per-file progress bars ("Writing model shards",
"Loading weights"). megarl's own warnings, and any other warning, still show.
`megarl --verbose` sets `MEGARL_VERBOSE=1`, which Ray workers inherit, and everything
shows again.
"""

from __future__ import annotations

import logging
import os
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
