"""Loading tokenizers: the small in-repo one ("builtin") or any local HF tokenizer directory.

The builtin tokenizer (`megarl/assets/tokenizer/`, built by
`megarl.data.build_tokenizer`) is what tests and tiny-model recipes use: no
model hub is reachable from our machines, so nothing is ever downloaded here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from megarl.errors import InputError
from megarl.userfiles import directory_problem, special_entries

BUILTIN = "builtin"


def builtin_tokenizer_dir() -> Path:
    """The directory of the in-repo tokenizer files (package data)."""
    return Path(str(resources.files("megarl") / "assets" / "tokenizer"))


def load_tokenizer(name_or_path: str = BUILTIN) -> Any:
    """A `transformers` fast tokenizer: "builtin", a local directory, or a hub id already in the local cache.

    Nothing is downloaded; a path that does not exist (and is not cached) is an InputError naming it.
    """
    from transformers import AutoTokenizer

    location = builtin_tokenizer_dir() if name_or_path == BUILTIN else name_or_path
    if Path(location).exists():  # else perhaps a hub id of the local cache
        problem = directory_problem(location)
        problems = [f"tokenizer {name_or_path!r}: {problem}"] if problem else [
            f"tokenizer {name_or_path!r}: {entry}" for entry in special_entries(location)]
        if problems:  # transformers would block on a FIFO among its files
            raise InputError(problems)
    try:
        return AutoTokenizer.from_pretrained(str(location), local_files_only=True)
    except (OSError, ValueError) as error:
        if not Path(location).exists():
            raise InputError(
                f"tokenizer {name_or_path!r}: no such directory (and not in the local Hugging Face cache)"
            ) from error
        reason = (str(error).splitlines() or [""])[0]
        raise InputError(f"tokenizer {name_or_path!r}: cannot load it ({type(error).__name__}: {reason})") from error
