"""End to end: `megarl train` on the quickstart recipe (shortened), on the session's Ray cluster.

Checks the contract of a run (every timing key and metric name of docs/metrics.md
that the recipe's phases produce, files in the run dir), that weight sync is
verified by `rollout/logprob_diff` ~ 0 right after each sync (the CPU engine really
drops its weights while the engines train, so a sync that missed a tensor shows),
that a fixed seed reproduces the run with the sleep/wake cycle switched off, that
no process of the run holds its API key on its command line, and that GRPO
improves the training score.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import megarl.controller.run as run_module
from megarl.config import load_recipe
from megarl.controller.run import train

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"

TIMING_KEYS = ["gen", "onload", "reward", "reward_total", "old_log_prob", "ref", "adv", "update_actor", "offload",
               "update_weights", "step"]
METRIC_KEYS = [
    *(f"critic/{group}/{stat}" for group in ("score", "rewards", "advantages", "returns")
      for stat in ("mean", "max", "min")),
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "actor/kl_loss",
    *(f"{group}/{stat}" for group in ("response_length", "prompt_length")
      for stat in ("mean", "max", "min", "clip_ratio")),
    "perf/throughput", "perf/weight_sync_gbps", "rollout/logprob_diff",
    "perf/max_memory_gb/actor", "perf/max_memory_gb/reference", "perf/max_memory_gb/rollout",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, name: str, *overrides: str, console: bool = False) -> list[dict]:
    recipe = load_recipe(QUICKSTART, [f"trainer.output_dir={tmp_path}", f"name={name}",
                                      f"trainer.logging.console={str(console).lower()}", *overrides])
    return _records(train(recipe))


def _check_the_log_of_a_file(err: str, run_dir: Path) -> None:
    """stderr went to a file (pytest's capture, no terminal): the banner, the warm-up's progress and its end, then
    exactly one plain line per step; controller.log has the banner, the warm-up's end and each validation."""
    lines = err.splitlines()
    warmup_limit = "at most 20" if load_recipe(QUICKSTART).sft_warmup.stop_loss is not None else "20"
    start = lines.index(f"megarl train a: fresh run, 2 steps after an SFT warm-up of {warmup_limit} steps")
    assert lines[start + 1] == f"  run dir  {run_dir}"
    assert lines[start + 2].startswith("  metrics  metrics.jsonl, sft_metrics.jsonl (the warm-up), tensorboard/")
    assert lines[start + 4].startswith("  layout   device cpu, colocated")
    warmup = [line.split("  ")[0] for line in lines if line.startswith("sft warm-up")]
    assert warmup[:2] == ["sft warm-up 1/20", "sft warm-up 20/20"] and len(warmup) == 3
    assert warmup[2].startswith("sft warm-up done at step 20, loss ") and warmup[2].endswith("step limit reached)")
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split("  ")[0] for line in steps] == ["step 1/2", "step 2/2"]
    assert " val " in steps[1] and "(step 2)" in steps[1] and "s/step  elapsed " in steps[0] and "gen " in steps[0]
    log = (run_dir / "logs" / "controller.log").read_text()
    for text in ("megarl train a: fresh run", "sft warm-up done at step 20", "validation at step 0: val/score/mean",
                 "validation at step 2: val/score/mean"):
        assert text in log, text
    assert len((run_dir / "sft_metrics.jsonl").read_text().splitlines()) == 20


class CommandLines:
    """Every command line on the machine, read from /proc every few milliseconds while in use: which held
    `secret` (any local user can read them), and how many megarl server processes were seen at all."""

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
        while not self._stop.wait(0.02):
            for path in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue  # the process ended meanwhile
                if self.secret in line:
                    self.leaks.append(line)
                if "megarl.rollout.cpu_engine" in line:
                    self.servers.add(path.parent.name)


@pytest.mark.e2e
@pytest.mark.dist
def test_short_run_logs_the_contract_and_reproduces(ray_session, tmp_path, monkeypatch, capsys):
    # KL in the loss switches the reference role (and `timing_s/ref`) on.
    overrides = ["trainer.total_steps=2", "trainer.val_every=2", "sft_warmup.steps=20",
                 "data.synthetic.num_val=64",
                 "actor.use_kl_loss=true", "trainer.checkpoint.save_every=1", "trainer.checkpoint.keep_last=1"]
    # The run's API key, known to the test: no process the run starts may carry it on its command line.
    key = "cmdline-probe-7f3c9a2e41b8d605"
    monkeypatch.setattr(run_module, "secrets", SimpleNamespace(token_hex=lambda nbytes: key))
    with CommandLines(key) as lines:
        first = _run(tmp_path, "a", *overrides, console=True)
    assert lines.servers and not lines.leaks, lines.leaks
    _check_the_log_of_a_file(capsys.readouterr().err, tmp_path / "a")
    steps = [record for record in first if "timing_s/step" in record]
    assert [record["step"] for record in steps] == [1, 2]
    for record in steps:
        missing = [f"timing_s/{key}" for key in TIMING_KEYS if f"timing_s/{key}" not in record]
        missing += [key for key in METRIC_KEYS if key not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        # The engine sampled with the weights the actor scores with: log-probs agree.
        assert record["rollout/logprob_diff"] < 1e-4
    assert "val/score/mean" in first[0] and "val/score/megarl/arithmetic" in steps[-1]
    run_dir = tmp_path / "a"
    assert "name: a\n" in (run_dir / "recipe.yaml").read_text()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # Saved every step, only the newest kept; the same command again resumes a finished run: nothing to do.
    assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step_2"]
    assert (run_dir / "checkpoints" / "step_2" / "actor" / "megarl_checkpoint.json").exists()
    assert _run(tmp_path, "a", *overrides) == first

    # Same seed, same run, now without the sleep/wake cycle: every sampled token, score and update is
    # identical. Only timings differ, and the engine's log-probs in their last bits (its batch
    # composition depends on request arrival, and with it the float summation order).
    second = _run(tmp_path, "b", *overrides, "placement.offload=false")
    assert not any("timing_s/onload" in record or "timing_s/offload" in record for record in second)
    volatile = ("timing_s/", "perf/", "time", "weight_sync/", "rollout/logprob_diff")

    def stable(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in records]

    assert stable(first) == stable(second)
    for a, b in zip(steps, [record for record in second if "timing_s/step" in record]):
        assert a["rollout/logprob_diff"] == pytest.approx(b["rollout/logprob_diff"], abs=1e-6)


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_grpo_improves_the_training_score(warmed_quickstart, tmp_path):
    # From where the recipe's own warm-up (stopped by loss) leaves the policy, 12 GRPO steps without validation,
    # with dynamic micro-batches (packed sequences) in log-probs and updates.
    records = _run(tmp_path, "learn", "trainer.total_steps=12", "trainer.val_every=0",
                   "actor.max_tokens_per_microbatch=1024", f"model.path={warmed_quickstart}", "sft_warmup.steps=0")
    scores = [record["critic/score/mean"] for record in records if "critic/score/mean" in record]
    assert len(scores) == 12
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    assert 0.0 < first < 0.8, f"the warm-up should leave the model imperfect, got {first:.3f}"
    assert last - first >= 0.05, f"score went from {first:.3f} to {last:.3f}"
    assert max(record["rollout/logprob_diff"] for record in records if "timing_s/step" in record) < 1e-4
