"""A worker killed for memory ends a command with one line: the role, the memory, the settings to change.

Ray's own exception objects are built with the messages its raylet writes (the
texts below are the formats of Ray 2.54 and of 2.55 on, as Ray's documentation
quotes them), and one real Ray actor is SIGKILLed, as the kernel's OOM killer
would, to check the words Ray really uses for a worker that vanished.
"""

from __future__ import annotations

import os
import re
import signal
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, GetTimeoutError, OutOfMemoryError, RayTaskError

from megarl import cli
from megarl.config import Recipe
from megarl.cluster.worker_group import WorkerGroup
from megarl.oom import NODE_SETTINGS, ROLE_SETTINGS, RoleOutOfMemory, find_role_oom, memory_kill
from megarl.rollout.fleet import RolloutFleet
from megarl.rollout.fleet_member import DEAD, FleetMember
from megarl.rollout.server_host import RayHost, ServerHost

# Ray up to 2.54 (raylet node_manager.cc): one killed task, its memory and the node's in one sentence.
OLD_FORMAT = (
    "Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 10.0.62.231, ID: e5d953ef03e55e26f13973ea1b5a0fd0ecc729cd820bc89e4aa50451) where the "
    "task (actor ID: 4f48435abed4c32e8891fa7f0d000000, name=MegatronWorker.update, pid=11362, memory used=9.81GB) "
    "was running was 27.71GB / 28.80GB (0.962273), which exceeds the memory usage threshold of 0.95. Ray killed "
    "this worker (ID: 6f2ec5c8b0d5f5a66572859faf192d36743536c2e9702ea58084b037) because it was the most recently "
    "scheduled task; to see more information about memory usage on this node, use `ray logs raylet.out -ip "
    "10.0.62.231`. To see the logs of the worker, use `ray logs worker-6f2ec5c8b0d5f5a66572859faf192d36743536c2e9702"
    "ea58084b037*out -ip 10.0.62.231.`"
)
# Ray 2.55 on: a count of killed workers, the object store's figures, then every worker considered.
NEW_FORMAT = (
    "2 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.50.112, ID: "
    "4cb25bc084aeb5a31ca5402ad589ae042a71165a8e2dd8418fecee26) was 28.62GB / 30.00GB (0.954017), which exceeds the "
    "memory usage threshold of 0.950000\nObject store memory usage: [- objects spillable: 0\n- bytes in use: 42199]\n"
    "Ray killed 2 worker(s) based on the killing policy\nConsidered workers: [\n"
    "Selected to kill: (Task: job ID=01000000, lease ID=0600000001000000ffffffffffffffff, task name=ServerHost.exit_"
    "code, required resources={CPU: 0}, pid=3310152, actual memory used=0.67GB, worker ID=3e3d8f80b70d48b6)\n"
    "Selected to kill: (Task: job ID=01000000, lease ID=0400000001000000ffffffffffffffff, task name=MegatronWorker."
    "compute_log_prob, required resources={CPU: 1}, pid=3310153, actual memory used=21.64GB, worker ID=0e5649d39c1)\n"
    "(Task: job ID=01000000, lease ID=0500000001000000ffffffffffffffff, task name=MegatronWorker.update, required "
    "resources={CPU: 1}, pid=3310151, actual memory used=21.95GB, worker ID=34241048bfb59ac2)]\n"
    "To see more information about memory usage on this node, use `ray logs raylet.out -ip 10.0.50.112`"
)
# Ray 2.60, as its memory monitor killed an actor on this machine (RAY_memory_usage_threshold=0.02 for the
# capture; the object store's figures and the list of the node's top memory users shortened).
RAY_2_60 = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: "
    "8adc9316b99dada27dac0656999c85e68933ab05612c72446cd2dcae) was 3.27GB used / 23.54GB limit (0.138739)\n"
    "OOM kill reason: Memory usage 3499044864B exceeded threshold of 505521184B (2.0% of 25276059648B limit)\n"
    "Object store memory usage: [- objects spillable: 0\n- bytes spillable: 0\n\nEviction Stats:\n"
    "(global lru) capacity: 6841701580\n(global lru) bytes evicted: 0]\n"
    "Ray killed 1 worker(s) based on the killing policy\nConsidered workers: [\n"
    "Selected to kill: (Task: job ID=01000000, lease ID=00000000ed0a370a1073768c19e8aae62fd4d7840c696d1637a3882cc"
    "20c0305, task name=megarl-actor-0:MegatronWorker.__init__, required resources={}, pid=30001, actual memory "
    "used=0.05GB, worker ID=8de70a23abc862aabbfce52887b27079b457a1fe59c7b1496d410066)\n]\n"
    "Total non-selected idle workers: 1\nTotal non-selected idle workers USS bytes: 0.04GB\n"
    "To see more information about memory usage on this node, use `ray logs raylet.out -ip 192.0.2.2`\n"
    "Top 10 memory users: PID\tMEM(GB)\tCOMMAND\n29720\t0.07\tpython3 probe.py\n"
    "Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/ray-"
    "observability/user-guides/debug-apps/debug-memory.html. ... To adjust the kill threshold, set the environment "
    "variable `RAY_memory_usage_threshold` when starting Ray."
)
# What Ray says of an actor whose process vanished (its exit detail; the kernel's OOM killer sends SIGKILL).
SIGKILL_DETAIL = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. There are some potential root causes. "
    "(1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force is called. "
    "(3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors."
)


def _actor_died(detail: str) -> ActorDiedError:
    return ActorDiedError(ActorDiedErrorContext(error_message=detail, class_name="MegatronWorker",
                                                actor_id=bytes(16), pid=4242, name="megarl-actor-1"))


def test_the_older_message_gives_the_worker_the_node_and_the_limit():
    kill = memory_kill(OutOfMemoryError(OLD_FORMAT), names=("MegatronWorker.update",))
    assert (kill.by, kill.task, kill.worker_gb) == ("ray", "MegatronWorker.update", 9.81)
    assert (kill.node_used_gb, kill.node_total_gb, kill.node_fraction, kill.threshold) == (27.71, 28.8, 0.962273, 0.95)
    line = str(RoleOutOfMemory(kill, role="actor", rank=1, method="MegatronWorker.update"))
    assert line == ("out of memory: Ray killed actor rank 1 (MegatronWorker.update) using 9.81 GB; the node held "
                    "27.71 of 28.80 GB (0.96, over Ray's limit RAY_memory_usage_threshold=0.95); lower "
                    "actor.ppo_micro_batch_size and actor.logprob_micro_batch_size, or set "
                    "actor.max_tokens_per_microbatch, or run on nodes with more memory")


def test_the_message_of_ray_2_60_gives_the_limit_in_percent_and_the_actor_by_name():
    kill = memory_kill(OutOfMemoryError(RAY_2_60), names=("megarl-actor-0:", "MegatronWorker.update"))
    assert (kill.task, kill.worker_gb) == ("megarl-actor-0:MegatronWorker.__init__", 0.05)
    assert (kill.node_used_gb, kill.node_total_gb, kill.node_fraction) == (3.27, 23.54, 0.138739)
    assert kill.threshold == pytest.approx(0.02) and kill.reason is None  # the reason is the threshold's
    assert str(RoleOutOfMemory(kill, role="actor", rank=0, method="MegatronWorker.update")).startswith(
        "out of memory: Ray killed actor rank 0 (MegatronWorker.update) using 0.05 GB; the node held 3.27 of 23.54 "
        "GB (0.14, over Ray's limit RAY_memory_usage_threshold=0.02); lower actor.ppo_micro_batch_size")


def test_the_newer_message_gives_the_killed_worker_of_the_call_not_one_merely_considered():
    # MegatronWorker.update was considered but not selected: its 21.95 GB must not be reported.
    kill = memory_kill(OutOfMemoryError(NEW_FORMAT), names=("megarl-critic-0:", "MegatronWorker.compute_log_prob"))
    assert (kill.task, kill.worker_gb) == ("MegatronWorker.compute_log_prob", 21.64)
    assert (kill.node_used_gb, kill.node_total_gb, kill.threshold) == (28.62, 30.0, 0.95)
    # A call whose task is not listed gets the first worker killed.
    assert memory_kill(OutOfMemoryError(NEW_FORMAT), names=("MegatronWorker.offload",)).worker_gb == 0.67
    line = str(RoleOutOfMemory(memory_kill(OutOfMemoryError(NEW_FORMAT), names=("ServerHost.exit_code",)),
                               role="rollout server", rank=2, method="ServerHost.exit_code"))
    assert line.startswith("out of memory: Ray killed rollout server 2 (ServerHost.exit_code) using 0.67 GB; the node "
                           "held 28.62 of 30.00 GB (0.95, over Ray's limit RAY_memory_usage_threshold=0.95); lower "
                           "rollout.max_concurrency")


def test_missing_figures_are_said_to_be_unknown_and_a_cgroup_reason_is_given():
    kill = memory_kill(OutOfMemoryError("1 worker(s) were killed due to the node running low on memory.\n"
                                        "OOM kill reason: user cgroup memory upper bound was met or exceeded"))
    line = str(RoleOutOfMemory(kill, role="critic", rank=0, method="MegatronWorker.update"))
    assert ("Ray killed critic rank 0 (MegatronWorker.update) using an unknown amount; the node's memory use unknown "
            "(Ray: user cgroup memory upper bound was met or exceeded, Ray's limit RAY_memory_usage_threshold); "
            "lower critic.ppo_micro_batch_size") in line


def test_actor_deaths_are_told_apart():
    monitor = memory_kill(_actor_died(OLD_FORMAT), names=("MegatronWorker.update",))  # the monitor's text in it
    assert (monitor.by, monitor.worker_gb) == ("ray", 9.81)
    assert memory_kill(_actor_died(SIGKILL_DETAIL)).by == "sigkill"
    line = str(RoleOutOfMemory(memory_kill(_actor_died(SIGKILL_DETAIL)), role="reference", rank=3,
                               method="MegatronWorker.compute_log_prob"))
    assert line.startswith("out of memory: reference rank 3 (MegatronWorker.compute_log_prob) was killed by SIGKILL, "
                           "as a rule the kernel's out-of-memory killer (`dmesg` on its node tells); no memory "
                           "figures are known; lower actor.logprob_micro_batch_size")
    assert memory_kill(_actor_died("The actor was killed by `ray.kill`.")) is None
    assert memory_kill(RayTaskError("update", "Traceback ...", ValueError("bad"))) is None
    assert memory_kill(ValueError("SIGKILL")) is None  # megarl's own errors are never taken for one


class _Worker:
    def update(self) -> None: ...


class _Handle:
    def __init__(self, rank: int):
        self.rank = rank

    def __getattr__(self, name: str):
        rank = self.rank

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                return f"{name}-{rank}"

        return _Method


class _Pool:
    world_size = 3

    def reserve(self) -> None:
        pass

    def actor_options(self, rank: int) -> dict:
        return {}


# Ray 2.60's format with two actors of a group killed at once (its policy since 2.56 may kill several).
TWO_KILLED = (
    "2 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.1, ID: ab12) was "
    "30.10GB used / 31.00GB limit (0.970968)\nOOM kill reason: Memory usage 32318226432B exceeded threshold of "
    "31620000000B (95.0% of 33284210688B limit)\nRay killed 2 worker(s) based on the killing policy\n"
    "Considered workers: [\nSelected to kill: (Task: job ID=01000000, lease ID=01, task name=megarl-critic-1:"
    "MegatronWorker.__init__, required resources={CPU: 1}, pid=101, actual memory used=5.00GB, worker ID=aa)\n"
    "Selected to kill: (Task: job ID=01000000, lease ID=02, task name=megarl-critic-2:MegatronWorker.__init__, "
    "required resources={CPU: 1}, pid=102, actual memory used=7.25GB, worker ID=bb)\n]"
)


def test_a_group_names_its_role_and_the_rank_that_was_killed(monkeypatch):
    """ray.get of all ranks raises the kill; the group finds the rank whose own result is that kill, and that
    rank's own figure in Ray's list (by the actor's name)."""
    import ray

    class _Remote:
        def options(self, **options):
            return self

        def remote(self, *, rank: int, world_size: int):
            return _Handle(rank)

    def get(refs, timeout=None):
        if isinstance(refs, list) or refs == "update-2":
            raise OutOfMemoryError(TWO_KILLED)
        if refs == "update-1":
            raise GetTimeoutError("rank still in its collective")
        return None  # rank 0 returned

    monkeypatch.setattr(ray, "remote", lambda worker_cls: _Remote())
    monkeypatch.setattr(ray, "get", get)
    group = WorkerGroup(_Worker, _Pool(), name="critic")
    with pytest.raises(RoleOutOfMemory) as raised:
        group.run(_Worker.update)
    assert (raised.value.role, raised.value.rank, raised.value.method) == ("critic", 2, "_Worker.update")
    assert isinstance(raised.value.__cause__, OutOfMemoryError)
    assert str(raised.value).startswith("out of memory: Ray killed critic rank 2 (_Worker.update) using 7.25 GB; the "
                                        "node held 30.10 of 31.00 GB (0.97, over Ray's limit "
                                        "RAY_memory_usage_threshold=0.95); lower critic.ppo_micro_batch_size")
    # Any other failure of a call is Ray's own error, unchanged.
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: (_ for _ in ()).throw(_actor_died("ray.kill")))
    with pytest.raises(ActorDiedError):
        group.run(_Worker.update)


def test_a_rollout_host_names_its_server_and_the_fleet_error_carries_the_kill(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: (_ for _ in ()).throw(_actor_died(SIGKILL_DETAIL)))
    with pytest.raises(RoleOutOfMemory) as raised:
        RayHost(_Handle(0), 1).call(ServerHost.exit_code)
    assert str(raised.value).startswith("out of memory: rollout server 1 (ServerHost.exit_code) was killed by SIGKILL")

    # A retired server remembers the kill; once no server is left, the fleet's error is caused by it.
    retired = FleetMember(1, RayHost(_Handle(0), 1), state=DEAD, failure="found dead")
    retired.note_death()

    class _Fleet:
        _servers = [FleetMember(0, None, state=DEAD, failure="found dead"), retired]

    error = RolloutFleet._no_server_left(_Fleet())
    assert "server 1 at : dead; found dead" in str(error)
    assert str(find_role_oom(error)).startswith("out of memory: rollout server 1 (ServerHost.exit_code) was killed")


def test_a_server_process_gone_by_sigkill_is_a_memory_kill_and_one_that_exited_is_not():
    class _ExitedHost:
        def __init__(self, code: int):
            self.code = code

        def call(self, method, *args):
            assert method is ServerHost.exit_code
            return self.code

    killed, failed = FleetMember(4, _ExitedHost(-signal.SIGKILL)), FleetMember(5, _ExitedHost(1))
    for server in (killed, failed):
        assert not server.alive()
        server.note_death()
    assert str(killed.killed).startswith("out of memory: rollout server 4 was killed by SIGKILL")
    assert failed.killed is None


def _failing_run(first: RoleOutOfMemory):
    """A command whose teardown calls the dead worker again, then fails on something else: the first kill is
    the one to report."""
    def run(args):
        try:
            raise first
        finally:
            try:
                raise RoleOutOfMemory(first.kill, role="actor", rank=1, method="MegatronWorker.close_weight_sync")
            finally:
                raise RuntimeError("teardown failed")  # a teardown error on top, as an ExitStack raises it
    return run


@pytest.mark.parametrize("verb, command", [("train", "_cmd_train"), ("train-rm", "_cmd_train_rm"),
                                           ("bench", "_cmd_bench"), ("warmup", "_cmd_warmup")])
def test_the_cli_prints_one_line_and_exits_1(verb, command, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MEGARL_VERBOSE", "0")  # --verbose below sets it; restored after the test
    first = RoleOutOfMemory(memory_kill(OutOfMemoryError(OLD_FORMAT), names=("MegatronWorker.update",)), role="actor",
                            rank=1, method="MegatronWorker.update")
    monkeypatch.setattr(cli, command, _failing_run(first))
    argv = [verb, str(tmp_path / "recipe.yaml")] + (["--hf", str(tmp_path / "hf")] if verb == "warmup" else [])
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"error: {first}\n"
    assert "Traceback" not in err and "close_weight_sync" not in err

    assert cli.main(["--verbose"] + argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "teardown failed" in err
    assert err.endswith(f"error: {first}\n")


def test_a_real_sigkilled_ray_actor_is_reported_with_its_rank(ray_session):
    """What the kernel's OOM killer does to a rank, done to a real Ray actor: Ray's words for it are recognised."""
    from megarl.cluster.placement import ResourcePool

    class Victim:
        def __init__(self, rank: int, world_size: int):
            self.rank = rank

        def work(self) -> int:
            if self.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return self.rank

    pool = ResourcePool("oom-test", nodes=1, per_node=2, device="cpu", roles=["actor"])
    group = WorkerGroup(Victim, pool, name="actor")
    try:
        assert group.run_rank(0, Victim.work) == 0
        with pytest.raises(RoleOutOfMemory) as raised:
            group.run(Victim.work)
        assert (raised.value.kill.by, raised.value.rank) == ("sigkill", 1)
        assert str(raised.value).startswith("out of memory: actor rank 1 (Victim.work) was killed by SIGKILL")
    finally:
        group.kill()
        pool.release()


def _recipe_has(key: str) -> bool:
    model: type[BaseModel] | None = Recipe
    for part in key.split("."):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        model = next((kind for kind in typing.get_args(annotation) or (annotation,)
                      if isinstance(kind, type) and issubclass(kind, BaseModel)), None)
    return True


def test_every_setting_the_line_and_the_troubleshooting_page_name_is_a_recipe_key():
    page = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    section = page.split("## Ray out of memory", 1)[1].split("\n## ", 1)[0]
    named = re.compile(r"\b(?:actor|critic|reference|reward_model|rollout|placement)\.[a-z_.]+[a-z_]")
    keys = {key for text in [*ROLE_SETTINGS.values(), NODE_SETTINGS, section] for key in named.findall(text)}
    assert {"actor.ppo_micro_batch_size", "rollout.max_concurrency", "placement.offload"} <= keys
    assert [key for key in sorted(keys) if not _recipe_has(key)] == []
