"""`megarl plan` from the command line and the plan's parts that need no engine: the KV pool, the verdict, the
searches, bad input. The per-rank bytes are checked against allocated tensors in `test_plan_bytes`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import load_recipe
from megarl.models.spec import arch_from_hf
from megarl.plan.gpus import GIB, GPUS
from megarl.plan.kv_cache import kv_pool
from megarl.plan.plan import Options, plan_recipe

ROOT = Path(__file__).resolve().parents[1]
GRPO_8B = ROOT / "recipes" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml"
PPO_8B = ROOT / "recipes" / "ppo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml"


def _plan(recipe_path: Path, gpu: str, *overrides: str):
    return plan_recipe(load_recipe(recipe_path, list(overrides)), Options(gpu=GPUS[gpu]))


def test_the_kv_pool_follows_sglangs_rule():
    """Qwen3-8B on a TP2 server: 36 layers x (8 KV heads / 2) x 128 x 2 (K, V) x 2 bytes = 72 KiB per token; the
    pool is mem_fraction x what is free when the server starts - its weights."""
    arch = arch_from_hf(load_recipe(GRPO_8B).model.hf_config())
    free, weights_per_gpu = 79 * GIB, 8_190_735_360 * 2 // 2  # Qwen3-8B: 8.19e9 weights (untied head), bf16
    pool = kv_pool(arch, tp=2, dtype="bfloat16", free_bytes=free, mem_fraction=0.6,
                   sequences=1024, sequence_tokens=3072, max_running=256)
    assert pool.token_bytes == 36 * 4 * 128 * 2 * 2 == 73728
    assert pool.weight_bytes == weights_per_gpu
    assert pool.bytes == int(0.6 * free) - weights_per_gpu
    assert pool.tokens == pool.bytes // 73728
    assert pool.concurrent == min(256, pool.tokens // 3072) and pool.waves == -(-1024 // pool.concurrent)


def test_kv_heads_are_replicated_past_tp():
    arch = arch_from_hf(load_recipe(GRPO_8B).model.hf_config())  # 8 KV heads
    per_token = {tp: kv_pool(arch, tp=tp, dtype="bfloat16", free_bytes=80 * GIB, mem_fraction=0.6,
                             sequences=1, sequence_tokens=1, max_running=1).token_bytes for tp in (8, 16)}
    assert per_token[8] == per_token[16] == 36 * 1 * 128 * 2 * 2


@pytest.mark.parametrize("recipe_path", [GRPO_8B, PPO_8B])
def test_the_production_recipes_fit_an_h100_and_not_an_a100_40gb(recipe_path):
    fits = _plan(recipe_path, "h100-80gb")
    assert fits.fits, fits.problems
    small = _plan(recipe_path, "a100-40gb")
    assert not small.fits
    assert small.problems[0].startswith("train:actor: ") and "exceeds the 39.4 GiB of a a100-40gb by" in \
        small.problems[0]


def test_the_searches_answer_at_their_edge():
    """The largest micro-batch fits and twice it does not; the smallest TP fits and the next smaller does not."""
    small = _plan(GRPO_8B, "a100-40gb")
    micro = small.largest_micro_batch["actor"]
    assert _plan(GRPO_8B, "a100-40gb", f"actor.ppo_micro_batch_size={micro}").fits
    assert not _plan(GRPO_8B, "a100-40gb", f"actor.ppo_micro_batch_size={2 * micro}").fits
    tp = small.smallest_tp
    assert tp == 8 and _plan(GRPO_8B, "a100-40gb", f"actor.parallel.tp={tp}", f"reference.parallel.tp={tp}").fits


def _with_judge(tmp_path: Path, *overrides: str) -> list[str]:
    """Overrides that add an LLM judge: a Qwen3-8B-shaped model (the policy's config.json) in bf16."""
    judge = tmp_path / "judge"
    judge.mkdir(exist_ok=True)
    config = load_recipe(GRPO_8B).model.hf_config()
    (judge / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return [f"reward.judge={{model_path: {judge}, prompt_template: '{{prompt}} {{response}}'}}",
            "reward.combine=rm", *overrides]


def test_a_judge_on_the_rollouts_gpus_takes_its_share_of_what_the_rollout_left(tmp_path):
    """SGLang sizes a server from the memory free when it starts: the judge starts after the rollout fleet, so on the
    same GPUs its mem_fraction applies to what the fleet left (not to the device). It never releases its memory,
    so every phase's peak on those GPUs carries it."""
    alone = _plan(GRPO_8B, "h200", "reward.combine=rule")
    judged = _plan(GRPO_8B, "h200", *_with_judge(tmp_path, "reward.judge.mem_fraction=0.5"))
    fleet, judge = judged.pool, judged.judge_pool
    assert fleet == alone.pool  # the rollout fleet starts first: the judge changes nothing of it
    context = 1 << 29
    assert judge.free_bytes == fleet.free_bytes - context - fleet.weight_bytes - fleet.bytes
    assert judge.bytes == int(0.5 * judge.free_bytes) - judge.weight_bytes > 0
    assert judge.weight_bytes == 8_190_735_360 * 2  # bf16, reward.judge.tp 1
    resident = judge.weight_bytes + judge.bytes + context
    before = {peak.phase: peak.bytes for peak in alone.peaks}
    after = {peak.phase: peak.bytes for peak in judged.peaks}
    assert set(after) == set(before) and all(after[phase] == before[phase] + resident for phase in before)
    assert "judge KV pool" in next(peak for peak in judged.peaks if peak.phase == "rollout").parts
    assert judged.fits, judged.problems  # 112 GiB at the rollout's peak, of the H200's 139.8


def test_a_judge_too_small_for_one_verdict_is_named(tmp_path):
    """With 0.1 of what the rollout left (~5 GiB on an H200) the judge's 16 GiB of weights leave no KV pool: SGLang
    would refuse to start."""
    plan = _plan(GRPO_8B, "h200", *_with_judge(tmp_path, "reward.judge.mem_fraction=0.1"))
    assert plan.judge_pool.bytes == 0 and plan.judge_pool.tokens == 0
    judge_problems = [problem for problem in plan.problems if problem.startswith("reward.judge.mem_fraction: ")]
    assert judge_problems and "holds 0 tokens" in judge_problems[0]


def test_a_judge_on_a_pool_of_its_own_is_a_peak_of_that_pool(tmp_path):
    pools = ["placement.colocate=false", "placement.pools={train: {nodes: 1, gpus_per_node: 8}, "
             "judge: {nodes: 1, gpus_per_node: 8}}", "placement.roles={actor: train, reference: train, "
             "rollout: train, judge: judge}", "rollout.num_servers=4", "weight_sync.transport=distributed",
             "reward.judge.mem_fraction=0.9"]
    plan = _plan(GRPO_8B, "h200", *_with_judge(tmp_path, *pools))
    judge = plan.judge_pool
    assert judge.free_bytes == GPUS["h200"].memory_bytes - (1 << 29)  # alone on its GPUs
    peak = next(peak for peak in plan.peaks if peak.pool == "judge")
    assert (peak.phase, peak.bytes) == ("reward:judge", judge.weight_bytes + judge.bytes + (1 << 29))


def test_offload_off_keeps_the_engines_beside_the_fleet():
    on, off = _plan(PPO_8B, "h100-80gb"), _plan(PPO_8B, "h100-80gb", "placement.offload=false")
    assert off.pool.bytes < on.pool.bytes  # SGLang sizes its pool from what the resident engines leave
    peak = {p.phase: p.bytes for p in off.peaks}["train:actor"]
    assert peak > {p.phase: p.bytes for p in on.peaks}["train:actor"] + off.pool.weight_bytes


def test_a_reference_in_the_actors_processes_leaves_the_fleet_one_cuda_context_more():
    # The production recipe's reference shares the actor's pool and layout (TP4 x PP2): it runs inside the actor's
    # processes, so the servers start beside one CUDA context fewer than with the reference at TP2 on its own.
    fused, separate = _plan(GRPO_8B, "h100-80gb"), _plan(GRPO_8B, "h100-80gb", "reference.parallel.tp=2")
    assert separate.pool.free_bytes - fused.pool.free_bytes == -(1 << 29)
    assert fused.pool.bytes - separate.pool.bytes == pytest.approx(0.6 * (1 << 29), abs=1)  # mem_fraction 0.6


def test_plan_cli_prints_tables_and_json(capsys):
    assert main(["plan", str(GRPO_8B), "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "## memory per GPU" in out and "plan: fits on h200" in out.splitlines()[-1]
    assert main(["plan", str(GRPO_8B), "--gpu", "a100-40gb", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "megarl-bench-report/1" and report["settings"]["gpu"]["name"] == "a100-40gb"
    tables = {table["name"]: table for table in report["tables"]}
    assert set(tables) == {"memory per GPU", "rollout KV cache", "phase peaks", "step time", "verdict"}
    assert ["fits", False] in tables["verdict"]["rows"]


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "h900"], "error: --gpu: unknown device 'h900'; known: h100-80gb"),
    (["--set", "actor.nope=1"], "error: --set: actor.nope: unknown key"),
    (["--gpu-memory-gb", "80"], "error: --gpu-memory-gb/--gpu-tflops/--gpu-bw-gbs: give all three"),
])
def test_bad_input_is_one_line_and_status_2(capsys, argv, message):
    assert main(["plan", str(GRPO_8B), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_a_custom_device_is_planned_on_its_figures(capsys):
    assert main(["plan", str(GRPO_8B), "--gpu-memory-gb", "48", "--gpu-tflops", "300", "--gpu-bw-gbs", "1000",
                 "--json"]) in (0, 1)
    settings = json.loads(capsys.readouterr().out)["settings"]["gpu"]
    assert (settings["name"], settings["memory_gib"], settings["tflops"]) == ("custom", 48.0, 300.0)


@pytest.mark.parametrize("recipe_path", [GRPO_8B, PPO_8B])
def test_submit_refuses_gpus_too_small_for_a_production_recipe(tmp_path, monkeypatch, capsys, recipe_path):
    """2 x 8 A100-40GB are too small for the Qwen3-8B recipes (the actor's rank needs ~42 GiB): submit refuses with
    the plan's reason before writing anything; --force renders the job anyway, and the dry run shows the plan."""
    monkeypatch.chdir(tmp_path)
    argv = ["submit", str(recipe_path), "--nodes", "2", "--gpu", "a100-40gb", "--dry-run",
            "--set", f"trainer.output_dir={tmp_path / 'runs'}"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "## memory per GPU" in captured.err
    refusal = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert refusal[0].startswith("error: plan: train:actor: ") and refusal[0].endswith("(--force submits anyway)")
    assert "exceeds the 39.4 GiB of a a100-40gb by" in refusal[0] and captured.out == ""
    assert not (tmp_path / "runs").exists()
    assert main(argv + ["--force"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash")
    assert main(argv[:5] + ["h100-80gb"] + argv[6:]) == 0  # the same recipe on H100s fits


def test_activation_terms_per_token_and_layer():
    """Qwen3-8B (h 4096, q 4096, kv 1024, F 12288): 8h unsplit + 2(2q + 2kv) + 6F split = 126,976 bytes (31h; the
    GPT layer of Korthikanti et al. keeps 34h); sequence parallelism splits all of it over TP; without flash attention
    the softmax output adds 2 x heads x sequence; full recompute keeps the layer input (2h) alone."""
    from megarl.plan.memory import layer_activation_bytes

    arch = arch_from_hf(load_recipe(GRPO_8B).model.hf_config())
    h = 4096

    def per_token(**kwargs):
        return layer_activation_bytes(arch, **{"seq_len": 1000, "tp": 1, "sequence_parallel": False, "flash": True,
                                               "recompute": "none", **kwargs})

    assert per_token() == 8 * h + 2 * (2 * 4096 + 2 * 1024) + 6 * 12288 == 126976
    assert per_token(tp=4) == 8 * h + (126976 - 8 * h) / 4
    assert per_token(tp=4, sequence_parallel=True) == 126976 / 4
    assert per_token(flash=False) == 126976 + 2 * 32 * 1000
    assert per_token(flash=False, recompute="selective") == 126976
    assert per_token(recompute="full", tp=4, sequence_parallel=True) == 2 * h / 4


def test_the_distributed_optimizer_splits_master_weights_and_moments_over_dp():
    plain = _plan(PPO_8B, "h100-80gb")
    split = plan_recipe(load_recipe(PPO_8B), Options(gpu=GPUS["h100-80gb"], distributed_optimizer=True))
    actor, actor_split = (next(r for r in plan.roles if r.role == "actor") for plan in (plain, split))
    assert actor_split.layout.dp == 2 and actor_split.memory.gradients == actor.memory.gradients
    assert abs(actor_split.memory.optimizer - actor.memory.optimizer / 2) <= 12  # one parameter's rounding
