"""Bucket buffers: kept across syncs, in shared memory on CPU, mapped by handle in other processes.

The cross-process case (a TP peer writing into the sender's bucket, a server reading it)
runs in test_weightsync_transports; here the same mapping is opened in this process,
which goes through the same pickle and /dev/shm file.
"""

from __future__ import annotations

import torch

from megarl.weightsync.buffers import BufferRing, SharedMappings, share_handle


def test_ring_keeps_each_slots_buffer_until_it_must_grow():
    ring = BufferRing()
    first = ring.get(0, 1000)
    assert first.is_shared() and first.dtype == torch.uint8 and first.numel() == 1000
    assert ring.get(0, 800).data_ptr() == first.data_ptr()  # reused, not reallocated
    assert ring.get(1, 800).data_ptr() != first.data_ptr()
    grown = ring.get(0, 4000)
    assert grown.numel() == 4000 and grown.data_ptr() != first.data_ptr()


def test_a_mapped_handle_is_the_same_memory_and_stays_mapped():
    buffer = BufferRing().get(0, 4096)
    buffer.fill_(1)
    mappings = SharedMappings(kept=2)
    handle = share_handle(buffer)
    mapped = mappings.open(handle)
    mapped[:100] = 9  # a TP peer writing its part
    assert int(buffer[:100].sum()) == 900 and int(buffer[100:].sum()) == 3996
    assert mappings.open(handle) is mapped  # cached: no new mapping per bucket


def test_only_the_most_recent_mappings_are_kept():
    ring = BufferRing()
    handles = [share_handle(ring.get(slot, 64)) for slot in range(3)]
    mappings = SharedMappings(kept=2)
    opened = [mappings.open(handle) for handle in handles]
    assert mappings.open(handles[2]) is opened[2] and mappings.open(handles[1]) is opened[1]
    assert mappings.open(handles[0]) is not opened[0]  # the oldest was released, so it is mapped afresh


def test_a_plain_cpu_tensor_is_moved_into_shared_memory_when_shared():
    tensor = torch.arange(16, dtype=torch.float32)
    assert not tensor.is_shared()
    mapped = SharedMappings().open(share_handle({"flat": tensor}))["flat"]
    assert tensor.is_shared() and torch.equal(mapped, torch.arange(16, dtype=torch.float32))
