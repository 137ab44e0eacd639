"""Which address a process on this node gives others to reach it, and how to write one down (IPv4 or IPv6).

Never the address the hostname resolves to: Debian's default `/etc/hosts` maps
a machine's own name to 127.0.1.1, and a node with several cards may resolve it
to the wrong one. The node's address is the interface the recipe names
(`cluster.env.MEGARL_RAY_IFACE`, exported on every node by the launchers) or
else the one Ray itself uses for this node, which the launchers start every Ray
node on. Gloo picks its own interface by hostname too, so before a gloo group
with another node is formed, `gloo_interface_toward(peer)` points it at the
card that reaches the peer (unless `GLOO_SOCKET_IFNAME` is already set).
"""

from __future__ import annotations

import ipaddress
import os
import socket

IFACE_ENV = "MEGARL_RAY_IFACE"
GLOO_IFACE_ENV = "GLOO_SOCKET_IFNAME"
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address in brackets (`[fd00::1]:6379`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """The inverse of `host_port`; ValueError naming the text when it is not HOST:PORT."""
    host, colon, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if not colon or not port.isdigit() or not host or (":" in host and not bracketed):
        raise ValueError(f"expected HOST:PORT or [IPv6]:PORT (got {address!r})")
    return (host[1:-1] if bracketed else host), int(port)


def interface_address(name: str) -> str:
    """The address of interface `name`: its IPv4 address, else its first global IPv6 one; OSError if none."""
    import psutil

    addresses = psutil.net_if_addrs().get(name)
    if addresses is None:
        raise OSError(f"no network interface {name!r} on this node")
    ipv4 = [entry.address for entry in addresses if entry.family == socket.AF_INET]
    ipv6 = [entry.address.split("%")[0] for entry in addresses if entry.family == socket.AF_INET6]
    ipv6 = [address for address in ipv6 if not ipaddress.ip_address(address).is_link_local]
    if not ipv4 + ipv6:
        raise OSError(f"network interface {name!r} has no IPv4 or global IPv6 address")
    return (ipv4 + ipv6)[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that carries `address`, or None."""
    import psutil

    for name, entries in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in entries):
            return name
    return None


def node_address() -> str:
    """The address other nodes reach this one at: the interface `$MEGARL_RAY_IFACE` names, else Ray's node IP."""
    interface = os.environ.get(IFACE_ENV)
    if interface:
        return interface_address(interface)
    import ray.util

    return ray.util.get_node_ip_address()


def route_source(peer: str) -> str:
    """This node's address on the route to `peer` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def gloo_interface_toward(peer: str) -> str | None:
    """Point gloo at the interface that reaches `peer` (unless GLOO_SOCKET_IFNAME is set or `peer` is this host's
    loopback); returns the interface gloo will use, None for gloo's own choice."""
    if os.environ.get(GLOO_IFACE_ENV):
        return os.environ[GLOO_IFACE_ENV]
    if is_loopback(peer):
        return None
    try:
        interface = interface_of(route_source(peer))
    except OSError:
        return None  # no route: let gloo fail with its own error naming the peer
    if interface is not None:
        os.environ[GLOO_IFACE_ENV] = interface
    return interface
