"""A role's worker killed for memory, told in one line: which role, how much memory, which setting to change.

Two deaths are recognised in the errors Ray raises from a call on a worker:
- Ray's memory monitor killed it (`ray.exceptions.OutOfMemoryError`, or an actor
  error carrying the monitor's text): the raylet's message gives the node's memory
  ("was 22.90GB / 24.00GB (0.954)"; Ray 2.60: "was 3.27GB used / 23.54GB limit
  (0.139)"), Ray's limit, the `RAY_memory_usage_threshold` environment variable
  ("the memory usage threshold of 0.95"; Ray 2.60: "exceeded threshold of ...B
  (95.0% of ...B limit)") and, per killed worker, its task's name and "memory
  used=9.80GB" (older Ray) or "actual memory used=..." (newer Ray). Whatever figure
  the message lacks is said to be unknown.
- It died of SIGKILL without a word (an actor error whose exit detail names
  SIGKILL or the OOM killer; a rollout server's process that exited by SIGKILL):
  almost always the kernel's out-of-memory killer, which leaves no figures;
  `dmesg` on the node confirms it.

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
# "was 27.71GB / 28.80GB (0.962273)" (older Ray), "was 3.27GB used / 23.54GB limit (0.138739)" (Ray 2.60).
_NODE = re.compile(rf"was {_NUMBER}GB(?: used)? / {_NUMBER}GB(?: limit)? \({_NUMBER}\)")
# "exceeds the memory usage threshold of 0.95" (older Ray); "OOM kill reason: Memory usage 3499044864B exceeded
# threshold of 505521184B (2.0% of 25276059648B limit)" (Ray 2.60), which is the same limit, in percent.
_THRESHOLD = re.compile(rf"memory usage threshold of {_NUMBER}")
_THRESHOLD_PERCENT = re.compile(rf"exceeded threshold of \d+B \({_NUMBER}% of")
_REASON = re.compile(r"OOM kill reason: ([^\n;]+)")
# One killed (or considered) worker: "name=allocate_memory, pid=91085, memory used=24.99GB" (older Ray) or "task
# name=megarl-actor-0:MegatronWorker.__init__, required resources={}, pid=3471, actual memory used=2.85GB" (newer:
# an actor's task is its creation task, after the actor's name). Newer Ray lists every worker it considered, each
# one it killed after "Selected to kill:".
_WORKER = re.compile(rf"(?:name=(?P<name>[^\n]*?), (?:required resources=\{{[^}}]*\}}, )?)?pid=(?P<pid>\d+), "
                     rf"(?:actual )?memory used={_NUMBER}GB")
_SELECTED = "Selected to kill:"

# What bounds a role's memory in a recipe, by the name of its worker group (or "rollout server").
ROLE_SETTINGS = {
    "actor": "lower actor.ppo_micro_batch_size and actor.logprob_micro_batch_size, or set "
             "actor.max_tokens_per_microbatch",
    "reference": "lower actor.logprob_micro_batch_size (the reference's micro-batches too), or set "
                 "actor.max_tokens_per_microbatch",
    "critic": "lower critic.ppo_micro_batch_size, or set critic.max_tokens_per_microbatch",
    "reward_model": "lower reward_model.micro_batch_size (train-rm: reward_model.train.micro_batch_size), or "
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
    task: str | None = None  # the killed worker's task, e.g. "megarl-actor-0:MegatronWorker.__init__"
    node_used_gb: float | None = None
    node_total_gb: float | None = None
    node_fraction: float | None = None
    threshold: float | None = None  # RAY_memory_usage_threshold in effect
    reason: str | None = None  # newer Ray: "user cgroup memory upper bound was met or exceeded", ...


def parse_monitor_message(message: str, *, names: tuple[str, ...] = ()) -> MemoryKill:
    """The figures of a Ray memory-monitor message. Of the workers it killed, the one whose task name holds the
    first of `names` that any holds (an actor's name, then the method called), else the first listed."""
    node, reason = _NODE.search(message), _REASON.search(message)
    threshold, percent = _THRESHOLD.search(message), _THRESHOLD_PERCENT.search(message)
    chunks = message.split(_SELECTED)
    if len(chunks) > 1:  # newer Ray: the first worker after each "Selected to kill:" is one it killed
        found = [_WORKER.search(chunk) for chunk in chunks[1:]]
    else:
        found = list(_WORKER.finditer(message))
    workers = [((match["name"] or "").strip(), float(match[3])) for match in found if match]
    own = []
    for name in names:
        own = [worker for worker in workers if name in worker[0]]
        if own:
            break
    task, worker_gb = (own or workers or [("", None)])[0]
    return MemoryKill(by="ray", worker_gb=worker_gb, task=task or None,
                      node_used_gb=float(node[1]) if node else None, node_total_gb=float(node[2]) if node else None,
                      node_fraction=float(node[3]) if node else None,
                      threshold=float(threshold[1]) if threshold else float(percent[1]) / 100 if percent else None,
                      # The threshold's own reason is said by the limit; any other (a cgroup's bound) is kept.
                      reason=reason[1].strip() if reason and not percent else None)


def memory_kill(error: BaseException, *, names: tuple[str, ...] = ()) -> MemoryKill | None:
    """The memory kill `error` (raised by `ray.get`) reports, or None for any other error; `names` pick the
    worker of interest when Ray killed several (`parse_monitor_message`)."""
    import ray.exceptions

    text = str(error)
    if isinstance(error, ray.exceptions.OutOfMemoryError) or (
            isinstance(error, ray.exceptions.RayActorError) and MONITOR_TEXT in text):
        return parse_monitor_message(text, names=names)
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
                f"(`dmesg` on its node tells); no memory figures are known; {settings}")
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
