"""A run whose disk fills: said as such (which path, how much is free), never a worker's traceback.

A full disk rarely surfaces as an OSError with ENOSPC in the driver: a checkpoint is
written by the engine ranks (Ray tasks), and torch's zip writer reports a short write as
"unexpected pos 704 vs 598" inside megatron's CheckpointException. So a failure is read
as a full disk when its chain or message says ENOSPC, or when the disk it wrote to has
less room left than the write needed (`needed_bytes`, e.g. the size of the previous
checkpoint) or than `NEARLY_FULL_BYTES`. The result is an `OSError(ENOSPC)` naming the
path, which the CLI prints as one line with exit status 2.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from megarl.errors import free_space

# Less than this left on a disk that a write just failed on: the write failed because the disk is full.
NEARLY_FULL_BYTES = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "[errno 28]", "[Errno 28]")


def _chain(error: BaseException | None) -> list[BaseException]:
    seen, chain = set(), []
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _says_full(error: BaseException) -> bool:
    return any((isinstance(link, OSError) and link.errno in _FULL_ERRNOS) or any(text in str(link) for text in _FULL_TEXT)
               for link in _chain(error))


def disk_full_error(error: BaseException, path: Path, *, needed_bytes: int = 0, note: str = "") -> OSError | None:
    """The OSError(ENOSPC) to raise instead of `error` when the disk of `path` is full, else None: one already in
    the chain that names its file (a teardown failing on the same full disk must not hide it), or a new one
    naming `path`, ending with `note` (what is still intact)."""
    named = [link for link in _chain(error)
             if isinstance(link, OSError) and link.errno in _FULL_ERRNOS and link.filename is not None]
    if named:
        return named[-1]  # the first to fail: the others arose while handling it
    try:
        free = shutil.disk_usage(_existing(path)).free
    except OSError:
        return None
    if not _says_full(error) and free >= max(needed_bytes, NEARLY_FULL_BYTES):
        return None
    reason = f"No space left on device ({free_space(path)} on its disk"
    reason += f", {needed_bytes / 2**20:.1f} MiB needed)" if needed_bytes else ")"
    return OSError(errno.ENOSPC, reason + (f"; {note}" if note else ""), str(path))


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
