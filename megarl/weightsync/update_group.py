"""The trainer's side of an SGLang weight-update group: rank 0 of a fresh process group with the servers.

SGLang's `init_custom_process_group` protocol (`megarl.rollout.weight_wire.new_update_group`):
the trainer hosts a TCP store at `master_address:master_port`, every server TP rank
connects as `rank_offset + tp_rank`, and a process group is built outside the default
group from `PrefixStore(group_name, store)`. The trainer's half runs in a
thread while the servers' `/init_weights_update_group` calls are in flight, so
a server that answers with an error fails the set-up at once instead of after
the timeout; a server that never joins fails it after `timeout_s`, with an
error naming the group and each server's state.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from megarl.rollout.client import RolloutClient, RolloutError
from megarl.rollout.weight_wire import new_update_group
from megarl.weightsync.session import WeightSyncError

POLL_S = 0.02


def init_update_group(client: RolloutClient, *, urls: list[str], tp_sizes: list[int], master_address: str,
                      master_port: int, group_name: str, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """Tell every server to join `group_name` and join it as rank 0; WeightSyncError naming the peers on failure."""
    world_size = 1 + sum(tp_sizes)
    offsets = [1 + sum(tp_sizes[:index]) for index in range(len(urls))]
    phase = f"init weight-update group {group_name!r} (world size {world_size}, master {master_address}:{master_port})"
    pool = ThreadPoolExecutor(len(urls) + 1, thread_name_prefix="weight-sync-init")
    try:
        calls: list[Future] = [
            pool.submit(client.run, client.request(url, "POST", "/init_weights_update_group", {
                "master_address": master_address, "master_port": master_port, "rank_offset": offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}))
            for url, offset in zip(urls, offsets)
        ]
        hosting = pool.submit(new_update_group, master_address=master_address, master_port=master_port, rank=0,
                              world_size=world_size, group_name=group_name, backend=backend, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s + 5.0
        while not (hosting.done() and all(call.done() for call in calls)):
            failed = [(url, call) for url, call in zip(urls, calls) if call.done() and _failure(call)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        states = [f"rank {offset} = {url}: {_state(call)}" for url, offset, call in zip(urls, offsets, calls)]
        if hosting.done() and hosting.exception() is None and not any(_failure(call) for call in calls):
            return hosting.result()
        cause = hosting.exception() if hosting.done() else None
        raise WeightSyncError(f"{phase} failed or timed out after {timeout_s:.0f} s; servers: " + "; ".join(states)
                              + (f"; trainer side: {cause}" if cause else ""))
    finally:
        # A server that never joins leaves our half blocked until its own timeout: do not wait for it here.
        pool.shutdown(wait=False, cancel_futures=True)


def destroy_update_group(client: RolloutClient, group: dist.ProcessGroup, *, group_name: str) -> list[str]:
    """Ask the servers to leave `group_name` and destroy our half; returns problems instead of raising."""
    problems = []
    for url in client.urls:
        try:
            client.run(client.request(url, "POST", "/destroy_weights_update_group", {"group_name": group_name}))
        except RolloutError as error:
            problems.append(str(error))
    destroyer = threading.Thread(target=dist.destroy_process_group, args=(group,), daemon=True)
    destroyer.start()
    destroyer.join(10.0)
    return problems


def _failure(call: Future) -> str | None:
    if not call.done():
        return None
    error = call.exception()
    if error is not None:
        return str(error)
    reply = call.result()
    if isinstance(reply, dict) and reply.get("success") is False:
        return str(reply.get("message"))
    return None


def _state(call: Future) -> str:
    if not call.done():
        return "init call still pending (never joined)"
    failure = _failure(call)
    return f"init call failed: {failure}" if failure else "answered success"
