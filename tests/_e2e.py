"""The shortened quickstart runs the end-to-end tests share: each runs once per session (conftest's
`grpo_reference` and `ppo_reference`), the contract tests check what a run logs and writes on it, and
test_e2e_resume resumes copies of it, which must reproduce it.

The GRPO run is watched: its API key is fixed by the test, and no command line on the machine
may show it while the run lasts; its progress goes to the console, which is a file here (its
stderr, kept in `Run.stderr`).

Both are 4 steps with a checkpoint after every step (the 3 newest kept, so step 1's is pruned), validation
every 2 steps, sample rows written and a short warm-up; the entropy bonus makes sure every update moves the
actor (and with it the next step's samples).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
STEPS, WARMUP_STEPS = 4, 5
SHORT = ["trainer.logging.console=false", f"sft_warmup.steps={WARMUP_STEPS}", "sft_warmup.batch_size=32",
         "data.synthetic.num_val=16", f"trainer.total_steps={STEPS}", "trainer.val_every=2", "actor.entropy_coeff=0.01",
         "trainer.checkpoint.save_every=1", "trainer.checkpoint.keep_last=3", "trainer.samples.train_rows=2",
         "trainer.samples.val_rows=4"]
# GRPO with KL in the loss: the reference role (and its checkpoint) is part of the run.
GRPO_PROMPTS, GRPO_N = 8, 4
GRPO = [f"data.train_batch_size={GRPO_PROMPTS}", f"rollout.n={GRPO_N}", "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size=16", "actor.use_kl_loss=true"]
# PPO with both KL options: in the reward with the adaptive controller (its coefficient moves every step), and
# in the actor loss; the critic warm-up (step 1) freezes the actor.
PPO_KL = dict(coef=0.01, target=0.05, horizon=2000)
PPO = ["data.train_batch_size=16", "critic.warmup_steps=1", "critic.ppo_mini_batch_size=32",
       "actor.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size=16", "actor.ppo_micro_batch_size=16",
       "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
       *(f"algorithm.kl_ctrl.{key}={PPO_KL[name]}" for key, name in
         [("kl_coef", "coef"), ("target_kl", "target"), ("horizon", "horizon")]),
       "actor.use_kl_loss=true"]


API_KEY = "cmdline-probe-7f3c9a2e41b8d605"


class CommandLines:
    """Every command line on the machine, read from /proc every 0.1 s while in use: which held
    `secret` (any local user can read them), and which megarl server processes of this test process were seen
    (its descendants: another worker of the test suite starts servers of its own meanwhile)."""

    def __init__(self, secret: str):
        self.secret, self.leaks, self.servers = secret, [], set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):  # a server lives for seconds: 0.1 s sees every one, at a fifth of the CPU
            for path in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue  # the process ended meanwhile
                if self.secret in line:
                    self.leaks.append(line)
                if "megarl.rollout.cpu_engine" in line and _below_this_process(int(path.parent.name)):
                    self.servers.add(path.parent.name)


def _below_this_process(pid: int) -> bool:
    try:
        return os.getpid() in {parent.pid for parent in psutil.Process(pid).parents()}
    except psutil.Error:
        return False  # the process ended meanwhile


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@dataclass(frozen=True)
class Run:
    """A run of `recipe` (a file in recipes/) with `overrides`, in `run_dir`."""

    recipe: str
    overrides: tuple[str, ...]
    run_dir: Path
    watched: CommandLines | None = field(default=None, compare=False)
    stderr: str = field(default="", compare=False)

    def records(self) -> list[dict]:
        return records(self.run_dir)

    def train(self, output_dir: Path, name: str, *more: str, on_phase=None) -> Path:
        """`megarl train` of the same recipe and overrides (then `more`) as run `name` in `output_dir`;
        `on_phase(step, phase)` hears every phase as it starts (`megarl.controller.run.train`)."""
        from megarl.config import load_recipe
        from megarl.controller.run import train

        return train(load_recipe(RECIPES / self.recipe, [f"trainer.output_dir={output_dir}", f"name={name}",
                                                         *self.overrides, *more]), on_phase=on_phase)


def reference_run(recipe: str, overrides: list[str], output_dir: Path, *, watch: bool = False) -> Run:
    """Run `recipe` with SHORT and `overrides` as run "full" in `output_dir`; with `watch`, under API_KEY and
    with every command line watched for it (`Run.watched`), its progress on the console (`Run.stderr`)."""
    run = Run(recipe, (*SHORT, *overrides), output_dir / "full")
    if not watch:
        assert run.train(output_dir, "full") == run.run_dir
        return run
    import megarl.controller.run as run_module

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, CommandLines(API_KEY) as lines, contextlib.redirect_stderr(err):
        patch.setattr(run_module, "secrets", SimpleNamespace(token_hex=lambda nbytes: API_KEY))
        assert run.train(output_dir, "full", "trainer.logging.console=true") == run.run_dir
    return Run(run.recipe, run.overrides, run.run_dir, lines, err.getvalue())
