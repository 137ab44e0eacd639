"""PolicyEngine: the Megatron actor (trainable) or reference policy (frozen) of one rank.

Constructed inside an initialised distributed process (`init_distributed`). Tensors in,
tensors out: the controller hands each DP rank its share of the batch; every rank of
the TP/PP group of that share receives the same tensors, runs its part of the
pipeline, and gets the same results back (computed on the last stage, broadcast over
the pipeline). Sequences are `input_ids` = left-padded prompt + right-padded response
([B, P + R]); a response token's log-prob is read from the logits one position earlier.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import torch

from megarl.engines import cpu_compat, gpt, hf_weights
from megarl.engines.engine_base import MegatronEngine, global_normalisers
from megarl.engines.losses import (
    PPOSettings,
    dp_sum,
    loss_scale,
    ppo_loss,
    reduce_ppo_metrics,
    reduce_sft_loss,
    response_log_probs,
    sft_loss,
)
from megarl.engines.optim import TrainState, build_train_state
from megarl.engines.schedule import MicroBatches, run_schedule

Tensor = torch.Tensor


class PolicyEngine(MegatronEngine):
    """One rank of a Megatron policy: log-probs, PPO updates, SFT steps, HF weights in/out."""

    def __init__(
        self,
        *,
        hf_config: dict,
        weights=None,
        seed: int = 0,
        trainable: bool = True,
        params_dtype: str | torch.dtype | None = None,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        warmup_steps: int = 0,
        schedule: str = "constant",
        min_lr: float = 0.0,
        total_steps: int | None = None,
        tokenizer_path: str | None = None,
    ):
        """`weights`: an HF checkpoint dir, an HF state dict, or None for random weights from `seed`.

        `trainable=False` builds a frozen reference (no optimizer; the optimizer arguments are ignored).
        `tokenizer_path` is recorded in checkpoints for export (default: `weights` when it is a dir).
        """
        cpu_compat.install()
        self.hf_config = dict(hf_config)
        self.tokenizer_path = tokenizer_path or (str(weights) if isinstance(weights, (str, Path)) else None)
        self.model = gpt.build_gpt(hf_config, params_dtype=params_dtype)
        hf_weights.load_hf_weights(self.model, weights, seed=seed)
        self.peak_lr = lr
        self.train: TrainState | None = None
        self._update_calls = 0
        if trainable:
            self.train = build_train_state(
                self.model.chunks,
                self.model.config,
                lr=lr,
                weight_decay=weight_decay,
                betas=tuple(betas),
                eps=eps,
                clip_grad=clip_grad,
                warmup_steps=warmup_steps,
                schedule=schedule,
                min_lr=min_lr,
                total_steps=total_steps,
            )
        else:
            for param in itertools.chain.from_iterable(chunk.parameters() for chunk in self.model.chunks):
                param.requires_grad_(False)

    # ------------------------------------------------------------------ inference

    def compute_log_prob(
        self,
        *,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        response_length: int,
        temperature: float,
        micro_batch_size: int,
        with_entropy: bool,
        max_tokens_per_microbatch: int | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """(log_probs [B, R], entropy [B, R] or None), float32 CPU, on every rank.

        `max_tokens_per_microbatch` packs sequences into micro-batches of at most that
        many tokens instead of `micro_batch_size` padded rows (collective over DP).
        Values at response padding positions are meaningless (mask them).
        """
        cpu_compat.install()

        def loss_fn(mb, logits):
            log_probs, entropy = response_log_probs(
                self.model,
                mb,
                logits,
                response_length=response_length,
                temperature=temperature,
                with_entropy=with_entropy,
            )
            return logits.new_zeros(()), {
                "log_probs": log_probs.cpu(),
                "entropy": None if entropy is None else entropy.cpu(),
            }

        shape = (input_ids.shape[0], response_length)
        out = self._forward_rows(
            {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            loss_fn=loss_fn,
            shapes={"log_probs": shape, **({"entropy": shape} if with_entropy else {})},
        )
        return out["log_probs"], out.get("entropy")

    # ------------------------------------------------------------------ training

    def _require_trainable(self) -> TrainState:
        if self.train is None:
            raise RuntimeError("this PolicyEngine was built with trainable=False (a frozen reference)")
        return self.train

    def update_policy(
        self,
        *,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        response_mask: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        ref_log_prob: Tensor | None = None,
        temperature: float = 1.0,
        ppo_epochs: int = 1,
        mini_batch_size: int | None = None,
        micro_batch_size: int = 8,
        shuffle: bool = True,
        seed: int = 0,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: float = 3.0,
        loss_agg_mode: str = "token-mean",
        entropy_coeff: float = 0.0,
        use_kl_loss: bool = False,
        kl_loss_coef: float = 0.0,
        kl_loss_type: str = "low_var_kl",
        max_tokens_per_microbatch: int | None = None,
    ) -> dict[str, float]:
        """PPO epochs x (shuffled) mini-batches of this DP rank's share; one optimizer step per mini-batch.

        The response length is `response_mask.shape[1]`. `mini_batch_size` is per DP rank
        (default: the whole share). Losses of a mini-batch are normalised by its global token /
        sequence counts (all DP ranks), so the gradient does not depend on the micro-batch split,
        nor on packing (`max_tokens_per_microbatch`, as in `compute_log_prob`).
        Returns the mean over mini-batches of actor/{pg_loss, pg_clipfrac, ppo_kl,
        pg_clipfrac_lower, entropy, grad_norm, lr} (+ actor/kl_loss), identical on every rank.
        """
        train = self._require_trainable()
        cpu_compat.install()
        if use_kl_loss and ref_log_prob is None:
            raise ValueError("use_kl_loss=True needs ref_log_prob")
        response_length = response_mask.shape[1]
        data = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask.float(),
            "old_log_probs": old_log_probs.float(),
            "advantages": advantages.float(),
        }
        if use_kl_loss:
            data["ref_log_prob"] = ref_log_prob.float()
        ppo = PPOSettings(
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            loss_agg_mode=loss_agg_mode,
            entropy_coeff=entropy_coeff,
            use_kl_loss=use_kl_loss,
            kl_loss_coef=kl_loss_coef,
            kl_loss_type=kl_loss_type,
        )
        return self._epochs_of_mini_batches(
            data,
            ppo_epochs=ppo_epochs,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            shuffle=shuffle,
            seed=seed,
            step=lambda mini, micro: self._ppo_mini_batch(train, mini, micro, response_length, temperature, ppo),
        )

    def _ppo_mini_batch(
        self,
        train: TrainState,
        mini: dict[str, Tensor],
        micro: MicroBatches,
        response_length: int,
        temperature: float,
        ppo: PPOSettings,
    ) -> dict[str, float]:
        """One optimizer step on one mini-batch; its metrics (same on every rank)."""
        loss_fn = functools.partial(
            ppo_loss,
            model=self.model,
            response_length=response_length,
            temperature=temperature,
            scale=loss_scale(len(micro)),
            normalisers=global_normalisers(mini["response_mask"]),
            ppo=ppo,
        )
        outputs, grad_norm, lr = self._optimizer_step(train, micro, loss_fn)
        return {**reduce_ppo_metrics(outputs, with_kl=ppo.use_kl_loss), "actor/grad_norm": grad_norm, "actor/lr": lr}

    def sft_step(
        self,
        *,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        loss_mask: Tensor,
        micro_batch_size: int,
        lr: float | None = None,
        max_tokens_per_microbatch: int | None = None,
    ) -> dict[str, float]:
        """One supervised step: token-mean NLL of the tokens where `loss_mask` [B, S] is 1.

        Token t is predicted from tokens < t (so loss_mask[:, 0] is ignored). Uses `lr`
        (default: the engine's peak lr) and does not advance the RL LR schedule.
        `max_tokens_per_microbatch` packs sequences as in `compute_log_prob`.
        Returns sft/loss (before the step), sft/grad_norm, sft/lr, sft/tokens.
        """
        train = self._require_trainable()
        cpu_compat.install()
        self._set_mode(True)
        tokens = max(float(dp_sum(loss_mask[:, 1:].float().sum().item())), 1.0)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "loss_mask": loss_mask,
        }
        micro = self._micro_batches(batch, micro_batch_size, max_tokens_per_microbatch)
        loss_fn = functools.partial(sft_loss, model=self.model, tokens=tokens, scale=loss_scale(len(micro)))
        train.zero_grad()
        outputs = run_schedule(self._chunks, micro, loss_fn=loss_fn, forward_only=False)
        lr = self.peak_lr if lr is None else lr
        grad_norm = train.step_with_lr(lr)
        return {
            "sft/loss": reduce_sft_loss(outputs),
            "sft/grad_norm": grad_norm,
            "sft/lr": float(lr),
            "sft/tokens": tokens,
        }

    # ------------------------------------------------------------------ weights

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full HF-named float32 CPU weights on every rank (collective over TP and PP)."""
        cpu_compat.install()
        return hf_weights.hf_state_dict(self.model)

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Replace the weights with a full HF state dict (every rank passes the same one)."""
        cpu_compat.install()
        hf_weights.load_hf_state_dict(self.model, state_dict)
        if self.train is not None:
            # A bf16 model trains fp32 main copies inside the optimizer: refresh them too.
            self.train.optimizer.reload_model_params()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, ckpt_dir: str | Path, *, tokenizer_path: str | None = None) -> Path:
        """Save weights (+ optimizer and LR schedule when trainable) to `ckpt_dir`; collective.

        Loadable at any parallel layout; `export_checkpoint` turns it into an HF checkpoint.
        `tokenizer_path` overrides the one given at construction.
        """
        return self._save_checkpoint(ckpt_dir, tokenizer_path=tokenizer_path or self.tokenizer_path)
