"""Benchmark: `megarl plan` against the step times NeMo-RL publishes for GRPO on DGX-H100 (Megatron training).

NeMo-RL v0.4's performance summary (docs/about/performance-summary.md of
NVIDIA-NeMo/RL, on-policy GRPO on OpenMathInstruct-2, BF16) lists, per model:
GPUs, samples generated per step (G-GBS), samples per optimizer step (T-GBS), the
layouts, the longest sequence allowed (4,096) and the mean one generated, and the
step time. Each row is rebuilt here as a megarl recipe (the 2x8 Qwen3-8B GRPO
recipe with that model's public HF config and those sizes, 64 prompts x 32
samples) and planned on `h100-80gb` with every sequence at the published mean
length. That is training's cost, but too short for generation: a step waits for
its longest response, so the second estimate stretches the decode steps to the
4,096-token limit while keeping the KV pool's waves of mean-length sequences.

    python benchmarks/plan_published.py
"""

from __future__ import annotations

from pathlib import Path

from megarl.bench import Column, Report
from megarl.config import load_recipe
from megarl.plan.gpus import GPUS
from megarl.plan.plan import Options, plan_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml"
PROMPT = 300  # of the published mean length, the prompt's share (OpenMathInstruct-2 problems are short)
MAX_SEQUENCE = 4096
LLAMA_8B = ("{model_type: llama, vocab_size: 128256, hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: "
            "32, num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 131072, rope_theta: 500000, "
            "rms_norm_eps: 1.0e-5, tie_word_embeddings: false}")
QWEN3_32B = ("{model_type: qwen3, vocab_size: 151936, hidden_size: 5120, intermediate_size: 25600, num_hidden_layers: "
             "64, num_attention_heads: 64, num_key_value_heads: 8, head_dim: 128, max_position_embeddings: 40960, "
             "rope_theta: 1000000, rms_norm_eps: 1.0e-6, tie_word_embeddings: false}")
# (name, model config, nodes, mean sequence, generation TP, training TP, PP, published step seconds)
ROWS = [
    ("LLAMA3.1_8B", LLAMA_8B, 2, 1060, 1, 1, 2, 97.7),
    ("Qwen3-32B", QWEN3_32B, 4, 3206, 4, 4, 4, 393.0),
]


def _overrides(config: str, nodes: int, response: int, gen_tp: int, tp: int, pp: int) -> list[str]:
    return ["model.path=null", f"model.config={config}", f"placement.nodes={nodes}", "data.train_batch_size=64",
            f"data.max_prompt_length={PROMPT}", f"data.max_response_length={response}", "rollout.n=32",
            f"rollout.tp={gen_tp}", f"rollout.num_servers={nodes * 8 // gen_tp}", "actor.ppo_mini_batch_size=512",
            "actor.ppo_micro_batch_size=1", "actor.logprob_micro_batch_size=1",
            f"actor.parallel={{tp: {tp}, pp: {pp}}}", f"reference.parallel={{tp: {tp}, pp: {pp}}}"]


def _step(plan, phases: tuple[str, ...] | None = None) -> float:
    return sum(t.seconds for t in plan.times if phases is None or t.phase in phases)


def main() -> None:
    report = Report.create("plan-vs-nemo-rl", {"gpu": "h100-80gb", "source": "NeMo-RL v0.4 performance summary"})
    table = report.add_table("GRPO step time", [
        Column("model"), Column("GPUs"), Column("plan, mean lengths", "s", ".1f"),
        Column("plan, decoding to 4096", "s", ".1f"), Column("published", "s", ".1f"),
        Column("published / plan", "", ".2f"), Column("actor peak", "GiB", ".1f")])
    options = Options(gpu=GPUS["h100-80gb"])
    for name, config, nodes, mean, gen_tp, tp, pp, published in ROWS:
        mean_plan = plan_recipe(load_recipe(RECIPE, _overrides(config, nodes, mean - PROMPT, gen_tp, tp, pp)), options)
        gen = _step(mean_plan, ("gen",))
        mixed = _step(mean_plan) - gen + gen * (MAX_SEQUENCE - PROMPT) / (mean - PROMPT)
        actor = next(peak.bytes for peak in mean_plan.peaks if peak.phase == "train:actor") / 2**30
        table.add_row(name, nodes * 8, _step(mean_plan), mixed, published, published / mixed, actor)
    print(report.to_markdown(with_settings=False))


if __name__ == "__main__":
    main()
