"""Paths a user names (recipes, model configs, checkpoints, tokenizers, data): regular files and directories only.

A FIFO blocks whoever opens it until a writer comes, and a device such as
`/dev/zero` reports a size of 0 and never ends: neither is a recipe, a data file
or a checkpoint, and a check that trusted `stat`'s size would read one forever.
`file_problem` / `directory_problem` say what a path is instead (None when it is
what was asked for); `read_bounded` reads a regular file but never more than its
limit, whatever `stat` said, and opens without blocking.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from megarl.errors import InputError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def file_problem(path: str | Path) -> str | None:
    """None when `path` is a regular file (links followed); else "no such file" or what it is instead."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as error:
        return f"cannot be read: {error.strerror}"
    return None if stat.S_ISREG(mode) else f"is {_kind(mode)}, not a regular file"


def directory_problem(path: str | Path) -> str | None:
    """None when `path` is a directory (links followed); else "no such directory" or what it is instead."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such directory"
    except OSError as error:
        return f"cannot be read: {error.strerror}"
    if stat.S_ISDIR(mode):
        return None
    return "is a regular file, not a directory" if stat.S_ISREG(mode) else f"is {_kind(mode)}, not a directory"


def special_entries(directory: str | Path) -> list[str]:
    """Problems of the entries of `directory` that are neither regular files nor directories (FIFOs, devices)."""
    problems = []
    for entry in sorted(Path(directory).iterdir()):
        problem = None if entry.is_dir() else file_problem(entry)
        if problem is not None and problem != "no such file":  # a dangling link is the reader's to report
            problems.append(f"{entry}: {problem}")
    return problems


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file `path`; InputError naming it when it is not one or holds more than `limit`."""
    problem = file_problem(path)
    if problem is not None:
        raise InputError(f"{path}: {problem}")
    # O_NONBLOCK: a FIFO swapped in after the check reads as empty instead of waiting for a writer.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"{path}: larger than {limit} bytes")
    return data
