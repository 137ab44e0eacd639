"""The Slurm client commands megarl submit drives: sbatch, squeue, sacct, scontrol and scancel, called and parsed.

A missing command or one that refuses (an unknown partition, an account the
user lacks) is input the user can fix, so it becomes an `InputError` carrying
Slurm's own message.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megarl.errors import InputError

# squeue lists queued and running jobs; scontrol remembers finished ones for MinJobAge (300 s by default);
# sacct remembers them for good: from the accounting database, or (-c) from the job completion log on
# clusters without one.
_SQUEUE_FORMAT = "%T|%M|%N|%r"
_SACCT_FIELDS = "State,ExitCode,Elapsed,NodeList"
_FIELD = re.compile(r"(\w+)=(\S*)")


@dataclass(frozen=True)
class JobState:
    state: str
    elapsed: str | None = None
    nodes: str | None = None
    reason: str | None = None
    exit_code: str | None = None

    @property
    def active(self) -> bool:
        return self.state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")

    def describe(self) -> str:
        parts = [self.state]
        if self.nodes and self.nodes != "(null)":
            parts.append(f"on {self.nodes}")
        if self.elapsed:
            parts.append(f"elapsed {self.elapsed}")
        if self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        if self.reason and self.reason not in ("None", "(null)"):
            parts.append(f"reason {self.reason}")
        return ", ".join(parts)


def _run(args: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which(args[0]) is None:
        raise InputError(f"{args[0]}: not found on PATH; megarl submit needs the Slurm client commands (or --dry-run)")
    result = subprocess.run(args, capture_output=True, text=True)
    if check and result.returncode != 0:
        message = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"
        raise InputError(f"{args[0]}: {message} (got {' '.join(args)})")
    return result


def sbatch(script: Path) -> str:
    """Submit `script`; the job id."""
    output = _run(["sbatch", "--parsable", str(script)]).stdout.strip()
    job_id = output.split(";")[0]
    if not job_id.isdigit():
        raise InputError(f"sbatch: unexpected answer {output!r} (got sbatch --parsable {script})")
    return job_id


def _sacct(job_id: str) -> JobState | None:
    """The job's last record in Slurm's accounting (or its completion log); None where neither knows it."""
    if shutil.which("sacct") is None:
        return None
    for source in ([], ["--completion"]):
        listed = subprocess.run(["sacct", *source, "--noheader", "--parsable2", "--allocations", "--jobs", job_id,
                                 "--format", _SACCT_FIELDS], capture_output=True, text=True)
        rows = [line.split("|") for line in listed.stdout.splitlines() if line.count("|") == 3]
        if listed.returncode == 0 and rows:
            state, exit_code, elapsed, nodes = rows[-1]  # a requeued job has one row per start: the newest last
            return JobState(state=state.split()[0], elapsed=elapsed, nodes=nodes, exit_code=exit_code)
    return None


def job_state(job_id: str) -> JobState | None:
    """The job's state from squeue while it is queued or running, else from sacct or scontrol; None once Slurm
    forgot it."""
    queued = _run(["squeue", "--noheader", "--jobs", job_id, "--format", _SQUEUE_FORMAT], check=False)
    line = queued.stdout.strip() if queued.returncode == 0 else ""
    if line:
        state, elapsed, nodes, reason = line.split("|", 3)
        return JobState(state=state, elapsed=elapsed, nodes=nodes, reason=reason)
    accounted = _sacct(job_id)
    if accounted is not None:
        return accounted
    shown = _run(["scontrol", "--oneliner", "show", "job", job_id], check=False)
    if shown.returncode != 0 or "JobState=" not in shown.stdout:
        return None
    fields = dict(_FIELD.findall(shown.stdout))
    return JobState(state=fields["JobState"], elapsed=fields.get("RunTime"), nodes=fields.get("NodeList"),
                    reason=fields.get("Reason"), exit_code=fields.get("ExitCode"))


def cancel(job_id: str, state: JobState) -> str:
    """Stop the job; a running one gets SIGTERM in its batch shell, for the driver. Says what was done."""
    if state.state == "PENDING":
        _run(["scancel", job_id])
        return f"job {job_id} was pending: removed from the queue"
    # Only the batch shell, which tells the driver (a plain `scancel --signal=TERM` signals every step:
    # the Ray nodes, which ignore it and tell the batch shell too).
    _run(["scancel", "--batch", "--signal=TERM", job_id])
    return (f"job {job_id}: sent SIGTERM to its batch script, which forwards it to the driver and then stops "
            f"Ray; `scancel {job_id}` stops it at once")
