"""Rendezvous addresses: the node's routable address, never what the hostname resolves to (127.0.1.1 under
Debian's default /etc/hosts), for masters, weight-update stores and servers bound to the node; IPv6 written in
brackets; gloo pointed at the card that reaches its peer.

The real thing, hosts whose names resolve to 127.0.1.1 and a gloo weight-update
group between two of them, runs in tests/test_slurm.py's two-node Slurm.
"""

from __future__ import annotations

import os
import socket

import psutil
import pytest
import ray.util

from megarl import net
from megarl.cluster.engine_worker import MegatronWorker
from megarl.rollout.server_host import bind_address
from megarl.weightsync.distributed_transport import _master_address

NODE_IP = "10.20.30.40"


@pytest.fixture
def debian_hosts(monkeypatch):
    """This host's name resolves to 127.0.1.1, as with Debian's default /etc/hosts; Ray knows the node as NODE_IP."""
    real = socket.gethostbyname
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1" if name == "node7" else real(name))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda *args: NODE_IP)
    monkeypatch.delenv(net.IFACE_ENV, raising=False)


def test_engine_master_and_weight_sync_store_use_the_nodes_address(debian_hosts):
    assert socket.gethostbyname(socket.gethostname()) == "127.0.1.1"  # the trap is set
    host, port = MegatronWorker(rank=0, world_size=4).master_endpoint()
    assert host == NODE_IP and 1024 <= port < 65536
    assert MegatronWorker(rank=0, world_size=1).master_endpoint()[0] == "127.0.0.1"  # no peer to reach it
    # The trainer hosts the weight-update group's TCP store: servers on other nodes must reach it.
    assert _master_address(["http://10.0.0.5:30000", "http://127.0.0.1:30001"]) == NODE_IP
    assert _master_address(["http://127.0.0.1:30000", "http://localhost:30001", "http://[::1]:30002"]) == "127.0.0.1"


def test_the_interface_the_recipe_names_wins(debian_hosts, monkeypatch):
    monkeypatch.setenv(net.IFACE_ENV, "lo")
    assert net.node_address() == "127.0.0.1"
    assert MegatronWorker(rank=0, world_size=2).master_endpoint()[0] == "127.0.0.1"
    monkeypatch.setenv(net.IFACE_ENV, "nosuchif0")
    with pytest.raises(OSError, match="no network interface 'nosuchif0' on this node"):
        net.node_address()


def test_servers_bound_to_the_node_listen_on_its_address(debian_hosts, monkeypatch):
    assert bind_address("node") == NODE_IP
    assert bind_address("10.9.8.7") == "10.9.8.7"  # an address the recipe names is used as it is
    monkeypatch.setenv(net.IFACE_ENV, "lo")
    assert bind_address("node") == "127.0.0.1"


def test_ipv6_addresses_are_bracketed_and_parsed_back():
    assert net.host_port("10.0.0.1", 6379) == "10.0.0.1:6379"
    assert net.host_port("fd77::2", 6379) == "[fd77::2]:6379"
    assert net.split_host_port("[fd77::2]:6379") == ("fd77::2", 6379)
    assert net.split_host_port("node1:80") == ("node1", 80)
    for bad in ("fd77::2", "10.0.0.1:", ":80", "host:port"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            net.split_host_port(bad)
    assert net.is_loopback("::1") and net.is_loopback("127.0.1.1") and net.is_loopback("localhost")
    assert not net.is_loopback("10.0.0.1") and not net.is_loopback("node1")


def _routable_interface() -> tuple[str, str] | None:
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                return name, entry.address
    return None


def test_gloo_is_pointed_at_the_card_that_reaches_the_peer(monkeypatch):
    monkeypatch.delenv(net.GLOO_IFACE_ENV, raising=False)
    assert net.gloo_interface_toward("127.0.0.1") is None  # loopback: gloo's own pick works on one host
    assert net.GLOO_IFACE_ENV not in os.environ
    card = _routable_interface()
    assert card is not None, "this machine has no network card with an IPv4 address"
    name, address = card
    assert net.route_source(address) == address and net.interface_of(address) == name
    assert net.gloo_interface_toward(address) == name
    assert os.environ[net.GLOO_IFACE_ENV] == name
    monkeypatch.setenv(net.GLOO_IFACE_ENV, "ib0")  # the user's choice is kept
    assert net.gloo_interface_toward("10.9.9.9") == "ib0"
