"""End to end: `megarl train` on recipes/quickstart-lora-cpu.yaml (shortened), from the session's warmed-up policy.

A LoRA run with the KL loss and the adapter-only sync: no reference engine runs (the KL
loss takes its log-probs from the actor with its adapters off), each sync moves the rank-1
adapter alone and the server's generations match the actor (`rollout/logprob_diff` ~ 0), a
checkpoint holds the adapters and their Adam state only, and a run resumed from it repeats
the uninterrupted step exactly (timings and the engine's last log-prob bits aside, as for
full fine-tuning in test_e2e_resume).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from megarl.config import load_recipe
from megarl.controller.run import train
from megarl.models import arch_from_hf, hf_param_shapes

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-lora-cpu.yaml"
VOLATILE = ("timing_s/", "perf/", "time", "weight_sync/seconds", "rollout/logprob_diff")


def _run(tmp_path: Path, warm: Path, *overrides: str) -> list[dict]:
    recipe = load_recipe(RECIPE, [f"trainer.output_dir={tmp_path}", "name=lora", "trainer.logging.console=false",
                                  f"model.path={warm}", *overrides])
    run_dir = train(recipe)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_lora_run_has_no_reference_engine_syncs_adapters_and_resumes_exactly(warmed_quickstart, tmp_path):
    # A quarter of the recipe's batch (16 prompts x 8 samples, two mini-batches), two steps, no validation: what
    # LoRA changes shows from the second step on, and the recipe's learning is the README's demonstration.
    overrides = ["trainer.total_steps=2", "trainer.val_every=0", "data.synthetic.num_val=16",
                 "data.train_batch_size=16", "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size=64",
                 "trainer.checkpoint.save_every=1", "trainer.checkpoint.keep_last=0"]
    records = _run(tmp_path, warmed_quickstart, *overrides)
    steps = [record for record in records if "timing_s/step" in record]
    assert [record["step"] for record in steps] == [1, 2]
    arch = arch_from_hf(json.loads((warmed_quickstart / "config.json").read_text()))
    full_bytes = 4 * sum(math.prod(shape) for shape in hf_param_shapes(arch).values())
    q_out, h, ffn = arch.num_attention_heads * arch.head_dim, arch.hidden_size, arch.ffn_hidden_size
    qkv = q_out + 2 * arch.num_query_groups * arch.head_dim
    adapter_bytes = 4 * arch.num_layers * ((5 * h + q_out + ffn) + (qkv + 2 * h + 2 * ffn))  # rank 1, PEFT form
    for record in steps:
        assert "timing_s/ref" in record and "actor/kl_loss" in record  # the KL loss ran ...
        assert "perf/max_memory_gb/reference" not in record  # ... without a reference engine
        assert record["rollout/logprob_diff"] < 1e-4  # the server generates with the actor's adapters
        assert record["weight_sync/bytes"] == adapter_bytes and full_bytes / adapter_bytes >= 50
    assert steps[-1]["actor/kl_loss"] > 0  # the adapters moved the policy off its base

    run_dir = tmp_path / "lora"
    checkpoint = run_dir / "checkpoints" / "step_1"
    assert sorted(path.name for path in checkpoint.iterdir() if path.is_dir()) == ["actor"]
    info = json.loads((checkpoint / "actor" / "megarl_checkpoint.json").read_text())
    assert info["lora"]["rank"] == 1 and info["lora"]["base"]["path"] == str(warmed_quickstart)
    stored = sum(path.stat().st_size for path in (checkpoint / "actor").glob("*.distcp"))
    assert stored < 4 * adapter_bytes + 100_000 < full_bytes  # adapters and Adam's moments, no base weights

    # Lose step 2's checkpoint and run again: the run resumes from step 1 (adapters moved, Adam's moments
    # non-zero, the data loader one batch on) and repeats step 2 exactly.
    shutil.rmtree(run_dir / "checkpoints" / "step_2")
    resumed = [r for r in _run(tmp_path, warmed_quickstart, *overrides) if "timing_s/step" in r]
    assert [record["step"] for record in resumed] == [1, 2]

    def stable(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}

    assert stable(resumed[-1]) == stable(steps[-1])
