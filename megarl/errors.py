"""The one exception type for bad user input (recipes, data files, CLI arguments).

Every layer raises `InputError` for input a user can fix; the CLI prints one
line per problem and exits with status 2 instead of showing a traceback.
Programming errors stay ordinary exceptions.
"""

from __future__ import annotations

import errno
import os
import shutil

# Failures of the disk, not of megarl: full, over quota, read-only, not ours to write.
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


class InputError(Exception):
    """Bad user input: each entry of `problems` is one line naming the key/file/row and the bad value."""

    def __init__(self, problems: str | list[str]):
        lines = [problems] if isinstance(problems, str) else list(problems)
        # A user's key or value may hold a line break; escaped, every problem stays one line.
        self.problems = [line.replace("\r", "\\r").replace("\n", "\\n") for line in lines]
        super().__init__("\n".join(self.problems))


def free_space(path: str | os.PathLike) -> str:
    """"N MiB free" (or KiB, below 1 MiB) on the disk of `path` (or of its nearest existing parent)."""
    where = os.path.abspath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return "free space unknown"
    return f"{free >> 20} MiB free" if free >= 1 << 20 else f"{free >> 10} KiB free"


def storage_problem(error: OSError) -> str | None:
    """One line for an OSError the disk caused (the CLI prints it instead of a traceback); None for any other.
    (`megarl.atomic.naming` puts the file and, for a full disk, the space left into the error.)"""
    if error.errno not in _STORAGE_ERRNOS:
        return None
    return f"cannot write {error.filename or 'a file'}: {error.strerror or os.strerror(error.errno)}"
