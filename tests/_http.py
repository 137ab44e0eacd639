"""One HTTP call to a server of the SGLang protocol, for tests that talk to servers directly."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(url: str, path: str, body: Any = None, *, method: str | None = None, key: str | None = None,
         raw: bytes | None = None, timeout: float = 120) -> tuple[int, Any]:
    """(status, the reply as JSON, or as text when it is not JSON, or None when empty) of `method url+path`.

    `body` is sent as JSON (`raw` as given); the method is POST with a body and GET without, unless said.
    """
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + path, data=data, headers=headers,
                                     method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    if not text.strip():
        return status, None
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def weight_checksums(url: str, *, key: str | None = None) -> dict[str, str]:
    """The per-tensor checksums a server's weight checker reports (`POST /weights_checker`, action checksum)."""
    status, reply = call(url, "/weights_checker", {"action": "checksum"}, key=key)
    assert status == 200 and reply["success"], reply
    return {name: checksum for rank in reply["ranks"] for name, checksum in rank["checksums"].items()}
