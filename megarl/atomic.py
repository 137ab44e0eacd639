"""Atomic writes: a file or directory a later run trusts is either complete or absent, never half written.

Everything is written under a temporary name in the same directory (so the final
rename stays on one filesystem), flushed to disk, then renamed into place. A
crash or a full disk in between leaves only the temporary, which the next writer
of the same path removes.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from megarl.errors import free_space


def _temporary(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError raised inside names `path` when it names no file itself (a full disk under pyarrow's or a
    plain file write's error names none), so the one line the CLI prints says which file; a full disk also
    says how much is free on it at that moment (before the partial file is removed)."""
    try:
        yield
    except OSError as error:
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        if error.errno is None or (error.filename is not None and not full):
            raise
        reason = os.strerror(error.errno) + (f" ({free_space(path)} on its disk)" if full else "")
        raise OSError(error.errno, reason, str(error.filename or path)) from error


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (the directory itself flushed)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_text(path: str | Path, text: str) -> None:
    """`path` holds exactly `text`, or (after a failure) what it held before."""
    path = Path(path)
    temporary = _temporary(path)
    try:
        with naming(path), open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def new_directory(path: str | Path) -> Iterator[Path]:
    """Yields an empty temporary directory to fill; on success it becomes `path` (which must not exist yet).

    On any failure the temporary is removed and `path` does not appear.
    """
    path = Path(path)
    temporary = _temporary(path)
    shutil.rmtree(temporary, ignore_errors=True)  # a crashed earlier attempt
    temporary.mkdir(parents=True)
    try:
        with naming(path):
            yield temporary
            for file in temporary.rglob("*"):
                if file.is_file():
                    with open(file, "rb") as handle:
                        os.fsync(handle.fileno())
        os.rename(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    fsync_dir(path.parent)


def write_files(writers: Mapping[Path, Callable[[Path], object]]) -> None:
    """Each writer fills the temporary it is given; only when all succeeded are they renamed to their paths.

    For files that belong together (a dataset's train and test splits): a failure leaves none of them new.
    """
    temporaries = {Path(path): _temporary(Path(path)) for path in writers}
    try:
        for path, write in writers.items():
            temporaries[Path(path)].parent.mkdir(parents=True, exist_ok=True)
            with naming(Path(path)):
                write(temporaries[Path(path)])
                with open(temporaries[Path(path)], "rb") as handle:
                    os.fsync(handle.fileno())
        for path, temporary in temporaries.items():
            os.replace(temporary, path)
    except BaseException:
        for temporary in temporaries.values():
            temporary.unlink(missing_ok=True)
        raise
    for directory in {path.parent for path in temporaries}:
        fsync_dir(directory)
