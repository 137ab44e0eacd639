"""The one exception type for bad user input (recipes, data files, CLI arguments).

Every layer raises `InputError` for input a user can fix; the CLI prints one
line per problem and exits with status 2 instead of showing a traceback.
Programming errors stay ordinary exceptions.
"""

from __future__ import annotations


class InputError(Exception):
    """Bad user input: each entry of `problems` is one line naming the key/file/row and the bad value."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
