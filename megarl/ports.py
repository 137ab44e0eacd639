"""Free TCP ports: the one probe every part uses (process-group masters, servers, broadcast groups).

The OS picks the port; it was free a moment ago and may be taken by the time
the caller binds it, so callers that can retry on a clash do.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` ("" = every interface) that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now (with SO_REUSEADDR, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Servers bind with SO_REUSEADDR, so connections of a killed server in TIME_WAIT do not block them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
