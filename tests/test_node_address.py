"""Masters other nodes must reach advertise the node's routable address, never the hostname's.

Under Debian's default /etc/hosts the hostname resolves to 127.0.1.1: a process-group master or a
weight-update group's TCP store advertised there is unreachable from every other node. The tests
make the hostname resolve to 127.0.1.1 and check that the engine master, the distributed
transport and servers bound to the node advertise the address Ray uses (or the named interface)
instead.
"""

from __future__ import annotations

import socket

import pytest
import ray.util
import torch

from megarl.cluster.engine_worker import MegatronWorker
from megarl.ports import NODE_IFACE_ENV, node_address
from megarl.rollout.server_host import bind_address
from megarl.weightsync.distributed_transport import _master_address

RAY_NODE_IP = "10.20.30.40"  # what Ray advertises for this node in these tests


@pytest.fixture
def debian_hostname(monkeypatch):
    """The hostname resolves to 127.0.1.1, Ray's node address is RAY_NODE_IP, no interface is named."""
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-node-7")
    monkeypatch.setattr(socket, "gethostbyname",
                        lambda name: "127.0.1.1" if name == "trainer-node-7" else "127.0.0.1")
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: RAY_NODE_IP)
    monkeypatch.delenv(NODE_IFACE_ENV, raising=False)


def test_a_multi_rank_engine_master_is_the_node_address_ray_uses(debian_hostname, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU path, where ranks span nodes
    host, port = MegatronWorker(rank=0, world_size=8).master_endpoint()
    assert host == RAY_NODE_IP and 0 < port < 65536
    assert MegatronWorker(rank=0, world_size=1).master_endpoint()[0] == "127.0.0.1"  # no peer to reach it


def test_the_update_group_store_is_the_node_address_for_remote_servers(debian_hostname):
    assert _master_address(["http://127.0.0.1:30000", "http://10.20.30.99:30000"]) == RAY_NODE_IP
    assert _master_address(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"


def test_a_named_interface_wins_over_ray(debian_hostname, monkeypatch):
    monkeypatch.setenv(NODE_IFACE_ENV, "lo")
    assert node_address() == "127.0.0.1"
    monkeypatch.setenv(NODE_IFACE_ENV, "nosuchif0")
    with pytest.raises(OSError):
        node_address()


def test_servers_bound_to_the_node_listen_on_the_same_address(debian_hostname, monkeypatch):
    assert bind_address("node") == RAY_NODE_IP
    monkeypatch.setenv(NODE_IFACE_ENV, "lo")
    assert bind_address("node") == "127.0.0.1"
    assert bind_address("10.9.8.7") == "10.9.8.7"  # an address the recipe names is used as it is
