"""PolicyEngine: the Megatron actor (trainable) or reference policy (frozen) of one rank.

Constructed inside an initialised distributed process (`init_distributed`). Rows in,
tensors out (`protocol.TrainEngine`): the controller hands each DP rank its share of the
batch; every rank of the TP/PP group of that share receives the same rows, runs its part
of the pipeline, and gets the same results back (computed on the last stage, broadcast
over the pipeline). Sequences are `input_ids` = left-padded prompt + right-padded
response ([B, P + R]); a response token's log-prob is read from the logits one position
earlier.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from pathlib import Path

import torch

from megarl.config.settings import Batching, LoraSettings, OptimizerSettings, PolicyUpdateSettings
from megarl.engines import cpu_compat, hf_weights, lora
from megarl.engines.engine_base import SEQUENCE_KEYS, MegatronEngine, check_finite, global_normalisers, pick
from megarl.engines.losses import (
    dp_sum,
    loss_scale,
    ppo_loss,
    reduce_ppo_metrics,
    reduce_sft_loss,
    response_log_probs,
    sft_loss,
)
from megarl.engines.protocol import Rows
from megarl.engines.schedule import MicroBatches, run_schedule

Tensor = torch.Tensor
UPDATE_KEYS = (*SEQUENCE_KEYS, "response_mask", "old_log_probs", "advantages")


class PolicyEngine(MegatronEngine):
    """One rank of a Megatron policy: log-probs, PPO updates, SFT steps, HF weights in/out."""

    def __init__(
        self,
        *,
        hf_config: dict,
        weights=None,
        seed: int,
        params_dtype: str | torch.dtype | None,
        transformer_impl: str,
        optimizer: OptimizerSettings | None,
        tokenizer_path: str | None = None,
        lora_settings: LoraSettings | None = None,
    ):
        """`weights`: an HF checkpoint dir, an HF state dict, or None for random weights from `seed`.

        `optimizer=None` builds a frozen reference. `tokenizer_path` is recorded in checkpoints
        for export (default: `weights` when it is a dir). `lora_settings`: the weights become a frozen
        base with LoRA adapters, the only parameters the optimizer trains (`megarl.engines.lora`).
        """
        self._build(hf_config, params_dtype=params_dtype, transformer_impl=transformer_impl, value_head=False)
        self.tokenizer_path = tokenizer_path or (str(weights) if isinstance(weights, (str, Path)) else None)
        hf_weights.load_hf_weights(self.model, weights, seed=seed)
        if lora_settings is not None:
            lora.attach_lora(self.model, lora_settings)
            self.lora_settings = lora_settings
            self.base_weights = {"path": str(weights) if isinstance(weights, (str, Path)) else None,
                                 "seed": seed}
        self._attach_optimizer(optimizer)

    # ------------------------------------------------------------------ inference

    def compute_log_prob(
        self, rows: Rows, *, temperature: float, with_entropy: bool, batching: Batching, adapters: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """(log_probs [B, R], entropy [B, R] or None), float32 CPU, on every rank; R = `responses`' width.

        Packed micro-batches (`batching.max_tokens_per_microbatch`) are collective over DP.
        Values at response padding positions are meaningless (mask them). `adapters=False`: the base
        model's, the LoRA adapters switched off (a LoRA actor's reference policy).
        """
        if not adapters and self.lora_settings is None:
            self._unsupported("LoRA adapters to switch off")
        response_length = rows["responses"].shape[1]

        def loss_fn(mb, logits):
            log_probs, entropy = response_log_probs(
                self.model, mb, logits, response_length=response_length, temperature=temperature,
                with_entropy=with_entropy,
            )
            return logits.new_zeros(()), {
                "log_probs": log_probs.cpu(),
                "entropy": None if entropy is None else entropy.cpu(),
            }

        shape = (rows["input_ids"].shape[0], response_length)
        with nullcontext() if adapters else lora.adapters_disabled(self.model):
            out = self._forward_rows(
                rows, batching=batching, loss_fn=loss_fn,
                shapes={"log_probs": shape, **({"entropy": shape} if with_entropy else {})},
            )
        return out["log_probs"], out.get("entropy")

    # ------------------------------------------------------------------ training

    def update(self, rows: Rows, settings: PolicyUpdateSettings) -> dict[str, float]:
        """PPO epochs x (shuffled) mini-batches of this DP rank's rows; one optimizer step per mini-batch.

        Losses of a mini-batch are normalised by its global token / sequence counts (all DP
        ranks), so the gradient does not depend on the micro-batch split, nor on packing.
        Returns the mean over mini-batches of actor/{pg_loss, pg_clipfrac, ppo_kl,
        pg_clipfrac_lower, grad_norm, lr} (+ actor/kl_loss), identical on every rank.
        """
        train = self._require_trainable()
        loss = settings.loss
        keys = UPDATE_KEYS + (("ref_log_prob",) if loss.use_kl_loss else ())
        if loss.use_kl_loss and "ref_log_prob" not in rows:
            raise ValueError("use_kl_loss needs ref_log_prob in the update's rows")
        data = pick(rows, keys, as_float=("response_mask", "old_log_probs", "advantages", "ref_log_prob"))
        response_length = data["response_mask"].shape[1]

        def step(mini: dict[str, Tensor], micro: MicroBatches) -> dict[str, float]:
            loss_fn = functools.partial(
                ppo_loss,
                model=self.model,
                response_length=response_length,
                temperature=settings.temperature,
                scale=loss_scale(len(micro)),
                normalisers=global_normalisers(mini["response_mask"]),
                ppo=loss,
            )
            outputs, grad_norm, lr = self._optimizer_step(train, micro, loss_fn)
            metrics = reduce_ppo_metrics(outputs, with_kl=loss.use_kl_loss)
            return {**metrics, "actor/grad_norm": grad_norm, "actor/lr": lr}

        return self._epochs_of_mini_batches(data, settings, step)

    def sft_step(self, rows: Rows, *, batching: Batching, lr: float) -> dict[str, float]:
        """One supervised step at `lr`: token-mean NLL of the tokens where `loss_mask` [B, S] is 1.

        Token t is predicted from tokens < t (so loss_mask[:, 0] is ignored). Does not advance
        the RL LR schedule. Returns sft/loss (before the step), sft/grad_norm, sft/lr, sft/tokens.
        """
        train = self._require_trainable()
        cpu_compat.install()
        self._set_mode(True)
        batch = pick(rows, (*SEQUENCE_KEYS, "loss_mask"))
        tokens = max(float(dp_sum(batch["loss_mask"][:, 1:].float().sum().item())), 1.0)
        micro = self._micro_batches(batch, batching)
        loss_fn = functools.partial(sft_loss, model=self.model, tokens=tokens, scale=loss_scale(len(micro)))
        train.zero_grad()
        outputs = run_schedule(self._chunks, micro, loss_fn=loss_fn, forward_only=False)
        grad_norm = train.step_with_lr(lr)
        metrics = {"sft/loss": reduce_sft_loss(outputs), "sft/grad_norm": grad_norm, "sft/lr": float(lr),
                   "sft/tokens": tokens}
        check_finite(metrics, where="an SFT step")
        return metrics
