"""A real two-node Slurm on one machine for the tests: two slurmd hosts in network namespaces, started by PID.

`start_slurm` installs munge, slurmctld, slurmd and slurm-client with apt-get
when they are missing (root only), then builds a private network: namespace
`<tag>-ctl` holds a bridge with the controller's address, and each host
namespace `<tag>-nK` is joined to it by a veth pair and has an address of its
own in 10.77.0.0/24 (and fd77::/64). These addresses exist only inside the
namespaces: nothing leaves them, and nothing on the machine reaches them by
accident. Each daemon runs as a host of its own: in its network namespace
(entered with nsenter, which leaves /sys and its cgroup mounts alone, unlike
`ip netns exec`), with its own hostname (a UTS namespace) and its own
/etc/hosts bound over the machine's (a private mount namespace) that maps that
name to 127.0.1.1, as Debian's default /etc/hosts does: `gethostbyname(
gethostname())` on a node gives an address no other node can reach, so
anything that rendezvouses by hostname fails here as it would on a cluster.

The configuration has two partitions on both nodes: `batch` (the default;
jobs there are preempted with PreemptMode=REQUEUE and a grace time) and
`urgent` (a higher PriorityTier that preempts them). Each node has one CPU, so
a pool of one process slot per node puts one on each host. Client commands run
in the controller's namespace (`cluster.client(...)`). `stop` cancels the
tests' leftover jobs, terminates exactly the processes started here and
deletes the namespaces and the temp dir. Where Slurm cannot be had (not root,
no apt-get, no network namespaces) `SlurmUnavailable` carries the reason to
skip with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo", "sacct")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
SUBNET, SUBNET6 = "10.77.0", "fd77::"
# The batch partition's preemption grace time: the stop budget of a recipe with preempt_timeout_s=30
# (30 + the driver's hard exit 60 + 15, then 60 for the teardown) fits in it.
GRACE_TIME_S = 180

CONFIG = """\
ClusterName=megarl-ci
SlurmctldHost={ctl}({subnet}.1)
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
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=2
KillWait=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
StateSaveLocation={root}/ctld-state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace}
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
NODE_LINE = "NodeName={name} NodeAddr={address} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
# A host: its network namespace (nsenter, which leaves /sys and its cgroup mounts alone, unlike `ip netns
# exec`), a private mount namespace with its own /etc/hosts bound over the machine's, and its own hostname.
HOST_SHELL = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'



class SlurmUnavailable(Exception):
    """Slurm cannot be installed or started here; the message is the reason to skip with."""


@dataclass
class SlurmCluster:
    root: Path
    tag: str
    nodes: dict[str, str]  # node name -> its address
    env: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)  # submitted by the tests: cancelled before the daemons stop

    @property
    def ctl_namespace(self) -> str:
        return f"{self.tag}-ctl"

    def namespace(self, node: str) -> str:
        return f"{self.tag}-{node.removeprefix(self.tag)}"

    def client(self, *argv: str) -> list[str]:
        """`argv` run in the controller's network namespace, where slurmctld is reachable."""
        return ["nsenter", f"--net=/run/netns/{self.ctl_namespace}", *argv]

    def on_host(self, name: str, namespace: str, *argv: str) -> list[str]:
        """`argv` run as host `name`: in `namespace`, its hostname `name`, which its /etc/hosts maps to 127.0.1.1."""
        hosts = self.root / f"hosts-{name}"
        # Debian's default /etc/hosts: the host's own name resolves to 127.0.1.1.
        hosts.write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost ip6-loopback\n")
        return ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--mount", "--uts", "sh", "-c", HOST_SHELL,
                "host", str(hosts), name, *argv]

    def on_node(self, node: str, *argv: str) -> list[str]:
        """`argv` run on `node`: its network namespace, hostname and /etc/hosts."""
        return self.on_host(node, self.namespace(node), *argv)

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.client(*argv), capture_output=True, text=True, env=self.env, timeout=timeout)

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def _queued(self) -> list[str]:
        try:
            listed = self.run("squeue", "--noheader", "--format", "%i", timeout=20)
        except subprocess.TimeoutExpired:
            return []
        return [job for job in listed.stdout.split() if job in self.jobs]

    def stop(self) -> None:
        """Cancel the tests' unfinished jobs, terminate the daemons started here (newest first) by PID, and
        delete the namespaces and the temp dir."""
        if self._queued():
            self.run("scancel", *self._queued())
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
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
        self.namespaces.clear()
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


def _ip(*args: str, namespace: str | None = None) -> None:
    argv = ["ip", *(("-n", namespace) if namespace else ()), *args]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise SlurmUnavailable(f"{' '.join(argv)}: {result.stderr.strip()}")


def _build_network(cluster: SlurmCluster) -> None:
    """The controller's namespace with a bridge, and one namespace per node wired to it by a veth pair."""
    ctl = cluster.ctl_namespace
    _ip("netns", "add", ctl)
    cluster.namespaces.append(ctl)
    _ip("link", "set", "lo", "up", namespace=ctl)
    _ip("link", "add", "br0", "type", "bridge", namespace=ctl)
    _ip("addr", "add", f"{SUBNET}.1/24", "dev", "br0", namespace=ctl)
    _ip("-6", "addr", "add", f"{SUBNET6}1/64", "dev", "br0", "nodad", namespace=ctl)
    _ip("link", "set", "br0", "up", namespace=ctl)
    for index, (node, address) in enumerate(cluster.nodes.items(), start=1):
        namespace = cluster.namespace(node)
        _ip("netns", "add", namespace)
        cluster.namespaces.append(namespace)
        outside, inside = f"{cluster.tag}v{index}", f"{cluster.tag}i{index}"
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", outside, "netns", ctl)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", outside, "master", "br0", "up", namespace=ctl)
        _ip("link", "set", "lo", "up", namespace=namespace)
        _ip("link", "set", inside, "name", "eth0", namespace=namespace)
        _ip("addr", "add", f"{address}/24", "dev", "eth0", namespace=namespace)
        _ip("-6", "addr", "add", f"{SUBNET6}{index + 1}/64", "dev", "eth0", "nodad", namespace=namespace)
        _ip("link", "set", "eth0", "up", namespace=namespace)
        # A default route through the controller's bridge gives Ray's "which address reaches the outside"
        # probe an answer (this namespace's own address); no packet leaves: nothing forwards beyond the bridge.
        _ip("route", "add", "default", "via", f"{SUBNET}.1", namespace=namespace)


def _node_states(cluster: SlurmCluster) -> dict[str, str]:
    listed = cluster.run("sinfo", "--noheader", "--Node", "--format", "%N %t")
    states = dict(line.split()[:2] for line in listed.stdout.splitlines() if len(line.split()) >= 2)
    return {node: states.get(node, "?") for node in cluster.nodes}


def start_slurm(num_nodes: int = 2) -> SlurmCluster:
    """Install if needed, build the namespaces, configure privately, start the daemons, wait until all nodes idle."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd and munged must be started as root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise SlurmUnavailable("no `ip` (iproute2) or `unshare` to build the test hosts' network namespaces")
    _install()
    root = Path(tempfile.mkdtemp(prefix="megarl-slurm-"))
    tag = f"mrl{os.getpid() % 100000}"
    nodes = {f"{tag}n{index}": f"{SUBNET}.{index + 1}" for index in range(1, num_nodes + 1)}
    memory_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemTotal:")))
    # One CPU per node: Ray on each offers one process slot, so a pool of one slot per node lands one per host.
    node_lines = "\n".join(NODE_LINE.format(name=name, address=address, cpus=1,
                                            memory_mb=memory_kb * 4 // 10 // 1024) for name, address in nodes.items())
    config = CONFIG.format(ctl=f"{tag}ctl", subnet=SUBNET, root=root, nodes=node_lines, grace=GRACE_TIME_S)
    (root / "ctld-state").mkdir()
    for name in nodes:
        (root / f"spool-{name}").mkdir()
    (root / "slurm.conf").write_text(config)
    cluster = SlurmCluster(root=root, tag=tag, nodes=nodes, env={**os.environ, "SLURM_CONF": str(root / "slurm.conf")})
    try:
        _build_network(cluster)
    except SlurmUnavailable:
        cluster.stop()
        raise
    _start_munge(cluster)
    # Foreground daemons (-D) are our children (nsenter, unshare and sh exec, they do not fork):
    # stopping them by PID stops exactly them.
    ctld = cluster.on_host(f"{tag}ctl", cluster.ctl_namespace, "slurmctld", "-D", "-i")
    cluster.processes.append(subprocess.Popen(ctld, env=cluster.env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))
    for name in nodes:
        command = cluster.on_node(name, "slurmd", "-D", "-N", name)
        cluster.processes.append(subprocess.Popen(command, env=cluster.env, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))
    _wait_until(lambda: set(_node_states(cluster).values()) == {"idle"}, timeout_s=90, what="nodes idle",
                cluster=cluster)
    return cluster
