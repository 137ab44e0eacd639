"""The optional supervised warm-up before RL: next-token loss on the task's reference solutions.

The CPU quickstart starts from random weights; a short warm-up teaches the
answer format so RL starts from a measurably imperfect but non-zero policy. A multi-turn
run warms up on tool-use traces instead: its environment's demonstrations, played with its
tools, trained on the model's turns only.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from statistics import mean

import torch

from megarl.config.settings import Batching, multi_turn_settings
from megarl.controller.multi_turn import Demonstrations
from megarl.controller.phases import assemble_rollout, split_generation_batch
from megarl.controller.roles import PolicyRole
from megarl.data.padding import right_pad
from megarl.protocol import Batch

# The loss the progress shows and `stop_loss` compares: the mean over this many recent steps.
RECENT_STEPS = 10


def sft_batch(prompts: Batch, tokenizer, *, max_response_length: int) -> Batch:
    """prompt + reference solution + eos, with `loss_mask` on the solution tokens only."""
    targets = [
        tokenizer.encode(info["answer"], add_special_tokens=False)[: max_response_length - 1] + [tokenizer.eos_token_id]
        for info in prompts["extra_info"]
    ]
    responses, lengths = right_pad(targets, tokenizer.pad_token_id, max_response_length)
    gen = split_generation_batch(prompts)
    full = assemble_rollout(gen, responses=responses, response_lengths=lengths,
                            rollout_log_probs=torch.zeros(responses.shape, dtype=torch.float32))
    prompt_width = gen["input_ids"].shape[1]
    loss_mask = full["attention_mask"].clone().float()
    loss_mask[:, :prompt_width] = 0
    full["loss_mask"] = loss_mask
    return full.select(["input_ids", "attention_mask", "position_ids", "loss_mask"])


def run_sft_warmup(actor: PolicyRole, data, recipe, tracker, *, stop_requested=lambda: False) -> int:
    """Warm up until `steps`, until the recent mean loss is below `stop_loss` or until `stop_requested()`;
    returns the steps run. With rollout.multi_turn the traces are the environment's demonstrations, played
    with the run's tools (`multi_turn.Demonstrations`). Every step's metrics go to the tracker
    (`sft_metrics.jsonl`, TensorBoard, the warm-up's progress); its end is one message, in
    `logs/controller.log` too."""
    from megarl.data.dataset import PromptLoader

    warmup = recipe.sft_warmup
    batching = Batching(recipe.actor.ppo_micro_batch_size, recipe.actor.max_tokens_per_microbatch)
    loader = PromptLoader(data.train_dataset, warmup.batch_size, shuffle=True, seed=recipe.seed + 1)
    demonstrations, multi_turn = None, multi_turn_settings(recipe)
    if multi_turn is not None:
        run_dir = Path(recipe.trainer.output_dir).expanduser() / recipe.name
        demonstrations = Demonstrations(multi_turn, tokenizer=data.tokenizer, run_dir=run_dir)
    recent: deque[float] = deque(maxlen=RECENT_STEPS)
    step = 0
    try:
        while step < warmup.steps and not stop_requested():
            prompts = Batch.from_dict(next(loader))
            batch = (demonstrations.batch(prompts) if demonstrations is not None else
                     sft_batch(prompts, data.tokenizer, max_response_length=recipe.data.max_response_length))
            metrics = actor.sft(batch, batching=batching, lr=warmup.lr)
            recent.append(metrics["sft/loss"])
            step += 1
            tracker.log_sft(step, metrics, limit=warmup.steps, loss=mean(recent), target=warmup.stop_loss)
            if warmup.stop_loss is not None and len(recent) == recent.maxlen and mean(recent) < warmup.stop_loss:
                break
    finally:
        if demonstrations is not None:
            demonstrations.close()
    if step:
        why = "stop requested" if stop_requested() else (
            "loss target reached" if step < warmup.steps else "step limit reached")
        tracker.message(f"sft warm-up done at step {step}, loss {mean(recent):.4f} (mean of the last {len(recent)} "
                        f"steps; {why})")
    # RL starts with fresh Adam moments: SFT momentum would otherwise keep moving the
    # weights even on steps whose advantages are all zero.
    actor.reset_optimizer_state()
    return step
