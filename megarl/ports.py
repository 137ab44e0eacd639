"""Network endpoints: free TCP ports and this node's routable address, the one probe of each that every part
uses (process-group masters, servers, broadcast groups, the Ray head).

The OS picks the port; it was free a moment ago and may be taken by the time
the caller binds it, so callers that can retry on a clash do.

The address is never the hostname's: `gethostbyname(gethostname())` is 127.0.1.1
under Debian's default /etc/hosts, and on a node with several cards whichever
one /etc/hosts lists, so ranks on other nodes could not reach a master there.
"""

from __future__ import annotations

import os
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


NODE_IFACE_ENV = "MEGARL_RAY_IFACE"  # the network interface a job names (slurm/README.md); Ray's pick without it
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of a network interface


def interface_address(interface: str) -> str:
    """The IPv4 address of network interface `interface` (OSError when it has none or does not exist)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("256s", interface.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24])


def node_address() -> str:
    """This node's address as other nodes reach it: the interface named by $MEGARL_RAY_IFACE, else the one Ray
    uses (inside a Ray process the address its node advertises; outside, the card of the default route)."""
    interface = os.environ.get(NODE_IFACE_ENV)
    if interface:
        return interface_address(interface)
    import ray.util

    return ray.util.get_node_ip_address()
