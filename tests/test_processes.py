"""megarl.processes: a shielded command survives the SIGTERM meant for the driver, and a sweep finds and stops
everything below it: its session, a grandchild in a session of its own, an orphan it reaped as subreaper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl import processes

# A parent (the shielded command) that starts a child in a session of its own, as a rollout server is
# started, and an orphan (a child whose parent exits at once: it is reparented to the subreaper) in a
# session of its own and without the mark, as a process that rewrote its environment; prints both, waits.
FAMILY = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
spawner = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys; env = dict(os.environ); "
                            "env.pop('MEGARL_PROCESS_MARK'); p = subprocess.Popen(['sleep', '600'], env=env, "
                            "start_new_session=True); print(p.pid, flush=True)"], stdout=subprocess.PIPE, text=True)
orphan = int(spawner.stdout.readline())
spawner.wait()
print(child.pid, orphan, flush=True)
time.sleep(600)
"""


def _blocked(pid: int) -> set[int]:
    mask = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("SigBlk:")), 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_shielded_family_survives_sigterm_and_the_sweep_stops_all_of_it():
    mark = f"test-{os.getpid()}"
    parent = subprocess.Popen([sys.executable, "-m", "megarl.processes", "shield", sys.executable, "-c", FAMILY],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, processes.MARK_ENV: mark})
    try:
        child, orphan = map(int, parent.stdout.readline().split())
        assert os.getsid(parent.pid) == parent.pid  # the shielded command leads a session of its own
        assert _parent(orphan) == parent.pid  # reparented to the subreaper, not to init
        for pid in (parent.pid, child):
            assert {signal.SIGTERM, signal.SIGUSR2} <= _blocked(pid), pid  # inherited by the child
        assert sorted(processes.marked(mark)) == sorted([parent.pid, child])  # the orphan lost its mark
        assert processes.family(mark, parent.pid) == sorted([parent.pid, child, orphan])
        os.kill(parent.pid, signal.SIGTERM)
        os.kill(child, signal.SIGTERM)
        time.sleep(1.0)
        assert _alive(parent.pid) and _alive(child)
        killed = processes.sweep(mark, parent.pid)
        assert sorted(set(killed)) == sorted([parent.pid, child, orphan])
        assert parent.wait(timeout=10) == -signal.SIGKILL
        assert not _alive(child) and not _alive(orphan) and processes.family(mark, parent.pid) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_servers_start_shielded_and_stop_on_sigint_only_under_the_shield(monkeypatch):
    monkeypatch.delenv(processes.SHIELD_ENV, raising=False)
    with processes.blocked_sigterm():
        plain = subprocess.Popen(["sleep", "60"])
    assert processes.stop_signal() == signal.SIGTERM and signal.SIGTERM not in _blocked(plain.pid)
    monkeypatch.setenv(processes.SHIELD_ENV, "1")
    with processes.blocked_sigterm():
        shielded = subprocess.Popen(["sleep", "60"])
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # the caller's mask is back
    assert processes.stop_signal() == signal.SIGINT and signal.SIGTERM in _blocked(shielded.pid)
    for process in (plain, shielded):
        process.kill()
        process.wait()


def test_a_sweep_never_kills_itself_or_its_caller():
    # A leader that is this test's own ancestor (its session leader, say) leaves this process alone.
    assert os.getpid() not in processes.family("no-such-mark", os.getsid(0))
    assert os.getppid() not in processes.family("no-such-mark", os.getsid(0))


@pytest.mark.parametrize("argv", [[], ["sweep"], ["sweep", "tag", "notapid"], ["nonsense", "x"]])
def test_usage_errors(argv, capsys):
    assert processes.main(argv) == 2
    assert "usage: python -m megarl.processes" in capsys.readouterr().err


class _Rank:
    """A megarl actor in miniature: shielded first thing, as MegatronWorker and ServerHost are."""

    def __init__(self):
        processes.shield_ray_actor()

    def state(self) -> tuple[int, str]:
        return os.getpid(), str(signal.getsignal(signal.SIGTERM))


@pytest.mark.dist
def test_a_shielded_ray_actor_outlives_sigterm_and_the_driver_does_not_ignore_it(ray_session, monkeypatch):
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this module
    actor = ray.remote(_Rank).options(num_cpus=0, runtime_env={"env_vars": {processes.SHIELD_ENV: "1"}}).remote()
    pid, handler = ray.get(actor.state.remote())
    assert handler == str(signal.SIG_IGN)  # Ray's own handler would end the worker
    os.kill(pid, signal.SIGTERM)
    assert ray.get(actor.state.remote())[0] == pid
    ray.kill(actor)
    # Outside an actor (the driver uses the same classes locally) nothing changes.
    monkeypatch.setenv(processes.SHIELD_ENV, "1")
    before = signal.getsignal(signal.SIGTERM)
    _Rank()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_led_family_is_swept_when_its_owner_dies_even_by_sigkill(tmp_path):
    mark = f"lead-{os.getpid()}"
    # The owner (as `megarl train` is for its own Ray head) starts a leader and is then SIGKILLed.
    owner = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        f"leader = subprocess.Popen([sys.executable, '-m', 'megarl.processes', 'lead', str(os.getpid()), "
        f"sys.executable, '-c', {FAMILY!r}], stdout=subprocess.PIPE, text=True, "
        f"env={{**os.environ, 'MEGARL_PROCESS_MARK': '{mark}'}})\n"
        "print(leader.pid, leader.stdout.readline().strip(), flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    leader, child, orphan = map(int, owner.stdout.readline().split())
    assert len(processes.family(mark, leader)) == 4  # the leader, its two descendants and the watchdog
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while processes.family(mark, leader) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes.family(mark, leader) == [] and not any(map(_alive, (leader, child, orphan)))
