"""A role's worker killed for memory, told in one line: which role, how much memory, which setting to change.

Two deaths are recognised in the errors Ray raises from a call on a worker:
- Ray's memory monitor killed it (`ray.exceptions.OutOfMemoryError`, or an actor
  error carrying the monitor's text): the raylet's message gives the node's memory
  ("was 22.90GB / 24.00GB (0.954)"), Ray's limit ("the memory usage threshold of
  0.95", the `RAY_memory_usage_threshold` environment variable) and, per killed
  worker, its task's name and "memory used=9.80GB" (older Ray) or "actual memory
  used=..." (newer Ray). Whatever figure the message lacks is said to be unknown.
- It died of SIGKILL without a word (an actor error whose exit detail names
  SIGKILL or the OOM killer): almost always the kernel's out-of-memory killer,
  which leaves no figures; `dmesg` on the node confirms it.

The caller that knows the role (a worker group, a rollout server's host) turns such
an error into `RoleOutOfMemory`, whose text is the line; the CLI finds it anywhere
in the chain of the error that ended a command (`find_role_oom`) and prints it
instead of a traceback. Imports no megarl package; Ray only inside the functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MONITOR_TEXT = "running low on memory"  # both of Ray's formats: "Task was killed due to ..." and "N worker(s) were ..."
# Ray's exit detail of a worker that vanished: "(1) The process is killed by SIGKILL by OOM killer ..."
SIGKILL_TEXTS = ("SIGKILL", "OOM killer")

_NUMBER = r"(\d+(?:\.\d+)?)"
_NODE = re.compile(rf"was {_NUMBER}GB / {_NUMBER}GB \({_NUMBER}\)")
_THRESHOLD = re.compile(rf"memory usage threshold of {_NUMBER}")
_REASON = re.compile(r"OOM kill reason: ([^\n;]+)")
# One killed (or considered) worker: "name=allocate_memory, pid=91085, memory used=24.99GB" (older Ray) or
# "task name=MegatronWorker.update, required resources={CPU: 1}, pid=3471, actual memory used=2.85GB" (newer).
_WORKER = re.compile(rf"(?:name=(?P<name>[^\n]*?), (?:required resources=\{{[^}}]*\}}, )?)?pid=(?P<pid>\d+), "
                     rf"(?:actual )?memory used={_NUMBER}GB")

# What bounds a role's memory in a recipe, by the name of its worker group (or "rollout server").
ROLE_SETTINGS = {
    "actor": "lower actor.ppo_micro_batch_size and actor.logprob_micro_batch_size, or set "
             "actor.max_tokens_per_microbatch",
    "reference": "lower actor.logprob_micro_batch_size (the reference's micro-batches too), or set "
                 "actor.max_tokens_per_microbatch",
    "critic": "lower critic.ppo_micro_batch_size, or set critic.max_tokens_per_microbatch",
    "reward_model": "lower reward_model.micro_batch_size (train-rm: reward_model.training.micro_batch_size), or "
                    "set reward_model.max_tokens_per_microbatch",
    "sft_warmup": "lower actor.logprob_micro_batch_size (the warm-up's micro-batches), or set "
                  "actor.max_tokens_per_microbatch",
    "rollout server": "lower rollout.max_concurrency (its requests in flight)",
}
# Every role: the node itself, or Ray's limit (which only hands the kill to the kernel when raised).
NODE_SETTINGS = "or run on nodes with more memory"


@dataclass(frozen=True)
class MemoryKill:
    """What Ray said about one kill; None where its message did not say."""

    by: str  # "ray" (its memory monitor) or "sigkill" (no word: the kernel's OOM killer, as a rule)
    worker_gb: float | None = None  # the killed worker's own memory
    task: str | None = None  # the killed worker's task, e.g. "MegatronWorker.update"
    node_used_gb: float | None = None
    node_total_gb: float | None = None
    node_fraction: float | None = None
    threshold: float | None = None  # RAY_memory_usage_threshold in effect
    reason: str | None = None  # newer Ray: "user cgroup memory upper bound was met or exceeded", ...


def parse_monitor_message(message: str, *, method: str | None = None) -> MemoryKill:
    """The figures of a Ray memory-monitor message; the killed worker is the one running `method` when the
    message lists several (newer Ray lists every worker it considered), else the first listed."""
    node, threshold, reason = _NODE.search(message), _THRESHOLD.search(message), _REASON.search(message)
    workers = [(match["name"], float(match[3])) for match in _WORKER.finditer(message)]
    selected = message.find("Selected to kill")
    if selected >= 0:  # newer Ray: the considered workers, the killed ones marked
        workers = [(m["name"], float(m[3])) for m in _WORKER.finditer(message, selected)] or workers
    own = [worker for worker in workers if method and worker[0] and worker[0].strip().endswith(method)]
    name, worker_gb = (own or workers or [(None, None)])[0]
    return MemoryKill(by="ray", worker_gb=worker_gb, task=name.strip() if name else None,
                      node_used_gb=float(node[1]) if node else None, node_total_gb=float(node[2]) if node else None,
                      node_fraction=float(node[3]) if node else None,
                      threshold=float(threshold[1]) if threshold else None,
                      reason=reason[1].strip() if reason else None)


def memory_kill(error: BaseException, *, method: str | None = None) -> MemoryKill | None:
    """The memory kill `error` (raised by `ray.get`) reports, or None for any other error."""
    import ray.exceptions

    text = str(error)
    if isinstance(error, ray.exceptions.OutOfMemoryError) or (
            isinstance(error, ray.exceptions.RayActorError) and MONITOR_TEXT in text):
        return parse_monitor_message(text, method=method)
    if isinstance(error, ray.exceptions.RayActorError) and any(word in text for word in SIGKILL_TEXTS):
        return MemoryKill(by="sigkill")
    return None


def _gb(value: float | None) -> str:
    return f"{value:.2f} GB" if value is not None else "an unknown amount"


def describe(kill: MemoryKill, *, role: str, rank: int | None, method: str | None) -> str:
    """The one line: who was killed, by whom, with which figures, and the settings to change."""
    # A worker group's workers are ranks; a fleet's servers are numbered ("rollout server 2").
    who = role if rank is None else f"{role} {rank}" if role == "rollout server" else f"{role} rank {rank}"
    doing = f" ({method})" if method else ""
    settings = f"{ROLE_SETTINGS.get(role, 'lower its micro-batch size')}, {NODE_SETTINGS}"
    if kill.by == "sigkill":
        return (f"out of memory: {who}{doing} was killed by SIGKILL, as a rule the kernel's out-of-memory killer "
                f"(`dmesg` on its node tells); Ray gives no memory figures for it; {settings}")
    node = "the node's memory use unknown"
    if kill.node_used_gb is not None and kill.node_total_gb is not None:
        node = f"the node held {kill.node_used_gb:.2f} of {kill.node_total_gb:.2f} GB"
    limit = "Ray's limit RAY_memory_usage_threshold" + (f"={kill.threshold:g}" if kill.threshold is not None else "")
    # Newer Ray names a reason (a cgroup's bound rather than the node's threshold, say): then that is the cause.
    why = [f"{kill.node_fraction:.2f}"] if kill.node_fraction is not None else []
    why += [f"Ray: {kill.reason}", limit] if kill.reason else [f"over {limit}"]
    return (f"out of memory: Ray killed {who}{doing} using {_gb(kill.worker_gb)}; {node} ({', '.join(why)}); "
            f"{settings}")


class RoleOutOfMemory(RuntimeError):
    """A role's worker was killed for memory; `str()` is the one line (`describe`). Raised from Ray's error."""

    def __init__(self, kill: MemoryKill, *, role: str, rank: int | None = None, method: str | None = None):
        self.kill, self.role, self.rank, self.method = kill, role, rank, method
        super().__init__(describe(kill, role=role, rank=rank, method=method))


def find_role_oom(error: BaseException) -> RoleOutOfMemory | None:
    """The first memory kill behind `error`: the deepest `RoleOutOfMemory` in its chain of causes and contexts
    (a teardown that calls the dead worker again raises another one on top of the first)."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RoleOutOfMemory):
            found = error
        error = error.__cause__ or error.__context__
    return found
