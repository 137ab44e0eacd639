"""The optional supervised warm-up before RL: next-token loss on the task's reference solutions.

The CPU quickstart starts from random weights; a short warm-up teaches the
answer format so RL starts from a measurably imperfect but non-zero policy. A multi-turn
run warms up on tool-use traces instead: its environment's demonstrations, played with its
tools, trained on the model's turns only.

What ends it early: a loss target (`stop_loss`, the mean of the last steps), or a held-out
accuracy (`stop_accuracy`): the share of held-out problems whose reference solution the
policy writes with every token at a probability above 1/2. A token above 1/2 is the argmax
whatever the others' values, so that share is what greedy decoding reproduces, and it only
moves when a probability is within float noise of 1/2. A loss target is met at different
accuracies: float noise moves the step where the model learns the carries by tens of steps,
and the accuracy at a given loss with it.
"""

from __future__ import annotations

import math
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
# `stop_accuracy` is checked on the validation set's first HELD_OUT_PROBLEMS problems, every CHECK_EVERY steps, and
# every step once the share is at half the target. The stop overshoots its target by what the last interval added,
# and where the quickstart learns the carries the share jumps by up to 0.16 in 5 steps (0.14 in one). A forward pass
# over its 500 problems costs ~0.3 s against ~0.45 s per step (2 cores): ~13% of the warm-up, and a few seconds
# more near the end.
CHECK_EVERY = 5
HELD_OUT_PROBLEMS = 512
# A reference token at a probability above this is the argmax, so greedy decoding writes it.
CONFIDENT_LOG_PROB = math.log(0.5)


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
    return full.select(["input_ids", "attention_mask", "position_ids", "responses", "loss_mask"])


def reproduced_share(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """The share of rows whose every supervised token (`loss_mask` [B, S] over the whole sequence; `log_probs`
    [B, R] of the last R tokens) has probability above 1/2."""
    supervised = loss_mask[:, -log_probs.shape[1]:] > 0
    written = ((log_probs > CONFIDENT_LOG_PROB) | ~supervised).all(dim=1)
    return int(written.sum()) / len(written)


class _Traces:
    """The warm-up's supervised batches of loader batches: reference solutions, or played demonstrations."""

    def __init__(self, data, recipe):
        self.tokenizer, self.max_response_length = data.tokenizer, recipe.data.max_response_length
        self.demonstrations, multi_turn = None, multi_turn_settings(recipe)
        if multi_turn is not None:
            run_dir = Path(recipe.trainer.output_dir).expanduser() / recipe.name
            self.demonstrations = Demonstrations(multi_turn, tokenizer=data.tokenizer, run_dir=run_dir)

    def batch(self, prompts: Batch) -> Batch:
        if self.demonstrations is not None:
            return self.demonstrations.batch(prompts)
        return sft_batch(prompts, self.tokenizer, max_response_length=self.max_response_length)

    def close(self) -> None:
        if self.demonstrations is not None:
            self.demonstrations.close()


def _held_out(data, traces: _Traces) -> Batch:
    from megarl.data.dataset import PromptLoader

    size = min(len(data.val_dataset), HELD_OUT_PROBLEMS)
    return traces.batch(Batch.from_dict(next(PromptLoader(data.val_dataset, size, shuffle=False, seed=0))))


def run_sft_warmup(actor: PolicyRole, data, recipe, tracker, *, stop_requested=lambda: False) -> int:
    """Warm up until `steps`, until a stopping rule is met (see the module docstring) or until `stop_requested()`;
    returns the steps run. With rollout.multi_turn the traces are the environment's demonstrations, played
    with the run's tools (`multi_turn.Demonstrations`). Every step's metrics go to the tracker
    (`sft_metrics.jsonl`, TensorBoard, the warm-up's progress), with `sft/reproduced` at each held-out check;
    its end is one message, in `logs/controller.log` too."""
    from megarl.data.dataset import PromptLoader

    warmup = recipe.sft_warmup
    batching = Batching(recipe.actor.ppo_micro_batch_size, recipe.actor.max_tokens_per_microbatch)
    loader = PromptLoader(data.train_dataset, warmup.batch_size, shuffle=True, seed=recipe.seed + 1)
    traces = _Traces(data, recipe)
    recent: deque[float] = deque(maxlen=RECENT_STEPS)
    step, reproduced, why, next_check = 0, None, "step limit reached", CHECK_EVERY
    try:
        held_out = _held_out(data, traces) if warmup.stop_accuracy is not None else None
        while step < warmup.steps and not stop_requested():
            metrics = actor.sft(traces.batch(Batch.from_dict(next(loader))), batching=batching, lr=warmup.lr)
            recent.append(metrics["sft/loss"])
            step += 1
            if held_out is not None and (step == next_check or step == warmup.steps):
                reproduced = reproduced_share(actor.response_log_probs(held_out), held_out["loss_mask"])
                metrics = {**metrics, "sft/reproduced": reproduced}
                next_check = step + (1 if reproduced >= warmup.stop_accuracy / 2 else CHECK_EVERY)
            tracker.log_sft(step, metrics, limit=warmup.steps, summary=_summary(mean(recent), reproduced, warmup))
            if warmup.stop_loss is not None and len(recent) == recent.maxlen and mean(recent) < warmup.stop_loss:
                why = "loss target reached"
                break
            if reproduced is not None and reproduced >= warmup.stop_accuracy:
                why = "held-out accuracy reached"
                break
    finally:
        traces.close()
    if step:
        why = "stop requested" if stop_requested() else why
        held_out_text = f", held-out problems reproduced {reproduced:.3f}" if reproduced is not None else ""
        tracker.message(f"sft warm-up done at step {step}, loss {mean(recent):.4f} (mean of the last {len(recent)} "
                        f"steps{held_out_text}; {why})")
    # RL starts with fresh Adam moments: SFT momentum would otherwise keep moving the
    # weights even on steps whose advantages are all zero.
    actor.reset_optimizer_state()
    return step


def _summary(loss: float, reproduced: float | None, warmup) -> str:
    """What the progress shows: `loss 0.6120 (target < 0.3500)`, `loss 0.6120  reproduced 0.312 (target >= 0.400)`,
    or the loss alone for a warm-up of a fixed number of steps."""
    text = f"loss {loss:.4f}" + (f" (target < {warmup.stop_loss:.4f})" if warmup.stop_loss is not None else "")
    if warmup.stop_accuracy is not None:
        shown = f"{reproduced:.3f}" if reproduced is not None else "-"
        text += f"  reproduced {shown} (target >= {warmup.stop_accuracy:.3f})"
    return text
