"""A real single-node Slurm for the tests: Debian's packages, a private configuration, daemons stopped by PID.

`start_slurm` installs munge, slurmctld, slurmd and slurm-client with apt-get
when they are missing (root only), writes a slurm.conf of its own in a temp
dir (its own ports, state and spool dirs, so a system Slurm is never touched),
starts munged (unless one already answers), slurmctld and slurmd in the
foreground as child processes, and waits until the node is idle. `stop`
cancels the tests' leftover jobs, terminates exactly those processes and
removes the temp dir. Where Slurm cannot be had (not root, no
apt-get, the install fails) `SlurmUnavailable` carries the reason to skip with.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megarl.ports import free_port

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")

# A configuration that started in 11-22 s on a 2-core machine, with private paths and ports.
CONFIG = """\
ClusterName=megarl-ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.log
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
ReturnToService=2
SchedulerParameters=sched_interval=2
KillWait=5
StateSaveLocation={root}/ctld-state
SlurmdSpoolDir={root}/slurmd-spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(Exception):
    """Slurm cannot be installed or started here; the message is the reason to skip with."""


@dataclass
class SlurmCluster:
    root: Path
    node: str
    env: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)  # submitted by the tests: cancelled before the daemons stop

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
        return "\n".join(parts)

    def _queued(self) -> list[str]:
        listed = subprocess.run(["squeue", "--noheader", "--format", "%i"], capture_output=True, text=True,
                                env=self.env)
        return [job for job in listed.stdout.split() if job in self.jobs]

    def stop(self) -> None:
        """Cancel the tests' unfinished jobs, then terminate the daemons this cluster started (newest first), by PID."""
        if self._queued():
            subprocess.run(["scancel", *self._queued()], env=self.env)
            deadline = time.monotonic() + 30
            while self._queued() and time.monotonic() < deadline:
                time.sleep(1)
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def _install() -> None:
    if all(shutil.which(command) for command in COMMANDS):
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(install, capture_output=True, text=True, env=env)
    if result.returncode != 0:  # stale or missing package lists
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
        result = subprocess.run(install, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {result.stderr.strip()[-400:]}")


def _munge_answers() -> bool:
    if not MUNGE_SOCKET.exists():
        return False
    credential = subprocess.run(["munge", "-n"], capture_output=True)
    return credential.returncode == 0 and subprocess.run(["unmunge"], input=credential.stdout,
                                                         capture_output=True).returncode == 0


def _wait_until(predicate, *, timeout_s: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        dead = [process.args[0] for process in cluster.processes if process.poll() is not None]
        if dead or time.monotonic() > deadline:
            reason = f"{', '.join(map(str, dead))} exited" if dead else f"not within {timeout_s:.0f} s"
            message = f"Slurm: {what}: {reason}\n{cluster.log_tail()}"
            cluster.stop()
            raise RuntimeError(message)
        time.sleep(0.5)


def _start_munge(cluster: SlurmCluster) -> None:
    if _munge_answers():
        return  # a munged is already serving this machine: use it, leave it running
    MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True)
    # setpriv execs munged as user munge, so the PID we hold is munged's own (runuser would sit in between).
    command = ["setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged", "--foreground"]
    cluster.processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_until(_munge_answers, timeout_s=30, what="munged answering", cluster=cluster)


def _node_state(cluster: SlurmCluster) -> str:
    result = subprocess.run(["sinfo", "--noheader", "--Node", "--format", "%t", "--nodes", cluster.node],
                            capture_output=True, text=True, env=cluster.env)
    return result.stdout.strip()


def start_slurm() -> SlurmCluster:
    """Install if needed, configure privately, start the daemons and wait until the node is idle."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd and munged must be started as root")
    _install()
    root = Path(tempfile.mkdtemp(prefix="megarl-slurm-"))
    host = socket.gethostname().split(".")[0]
    memory_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemTotal:")))
    config = CONFIG.format(host=host, root=root, ctld_port=free_port(), slurmd_port=free_port(),
                           cpus=os.cpu_count(), memory_mb=memory_kb * 8 // 10 // 1024)
    for directory in ("ctld-state", "slurmd-spool"):
        (root / directory).mkdir()
    (root / "slurm.conf").write_text(config)
    cluster = SlurmCluster(root=root, node=host, env={**os.environ, "SLURM_CONF": str(root / "slurm.conf")})
    _start_munge(cluster)
    # Foreground daemons (-D) are our children: stopping them by PID stops exactly them.
    cluster.processes.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=cluster.env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    cluster.processes.append(subprocess.Popen(["slurmd", "-D", "-N", host], env=cluster.env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_until(lambda: _node_state(cluster) == "idle", timeout_s=90, what=f"node {host} idle", cluster=cluster)
    return cluster
