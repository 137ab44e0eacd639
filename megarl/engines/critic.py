"""ValueEngine: one rank of the Megatron critic (the GAE value model).

The same GPT backbone as the policy, built with `gpt.build_gpt(value_head=True)`: the
last pipeline stage ends in a scalar `ValueHead` (replicated across TP) instead of the
LM output layer. The backbone comes from an HF checkpoint (the actor's, or
`critic.model_path`); the head starts at zero unless `head_init_std` > 0 (seeded), so
the first values are 0 and the first updates fit the head to the returns.

Alignment, the same as the log-probs': the value of response token t (t = 0..R-1) is
read at position P + t - 1 of the [B, P + R] sequence, i.e. V_t = V(state before token
t), the state the policy acted in. GAE's `delta_t = r_t + gamma * V_{t+1} - V_t` with
the outcome reward at the last valid token then bootstraps nothing past the end.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from megarl.algorithms.losses import value_loss
from megarl.engines import cpu_compat, gpt, hf_weights
from megarl.engines.engine_base import MegatronEngine, global_normalisers
from megarl.engines.losses import dp_sum, loss_scale
from megarl.engines.optim import TrainState, build_train_state
from megarl.engines.schedule import MicroBatches, broadcast_from_last_stage, is_output_stage

Tensor = torch.Tensor
CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac")


def response_values(mb: dict, output: Tensor, *, response_length: int) -> Tensor:
    """Values [n, R] of the last R tokens of each row, from the model output [b, T, 1].

    Token t's value sits one position earlier (the state before it). Packed micro-batches
    read it through `token_index`; positions whose token or predecessor is padding are 0.
    """
    values = output.squeeze(-1).float()
    if "token_index" not in mb:
        seq = values.shape[1]
        return values[:, seq - response_length - 1 : seq - 1]
    index = mb["token_index"]
    seq = index.shape[1]
    target_at = index[:, seq - response_length :]
    predictor_at = index[:, seq - response_length - 1 : seq - 1]
    valid = (target_at >= 0) & (predictor_at >= 0)
    return torch.where(valid, values[0][predictor_at.clamp(min=0)], torch.zeros((), device=values.device))


def critic_loss(
    mb: dict,
    output: Tensor,
    *,
    response_length: int,
    cliprange_value: float,
    loss_agg_mode: str,
    scale: int,
    normalisers: dict,
) -> tuple[Tensor, dict]:
    """Clipped value loss of one micro-batch (a share of its mini-batch's loss), scaled by `scale`."""
    vpreds = response_values(mb, output, response_length=response_length)
    mask = mb["response_mask"] * mb["valid_row"].unsqueeze(-1)
    loss, clipfrac = value_loss(
        vpreds, mb["returns"], mb["values"], mask, cliprange_value, loss_agg_mode, **normalisers
    )
    tokens = mask.sum().detach()
    return loss * scale, {"tokens": tokens, "critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac * tokens}


def _reduce_critic_metrics(outputs: list[dict]) -> dict[str, float]:
    """A mini-batch's loss (sum of micro-batch shares) and token-weighted clipfrac, over DP, on every stage."""
    local = torch.zeros(3, dtype=torch.float64)
    for info in outputs:  # empty on stages without the value head
        local += torch.tensor([float(info[name]) for name in (*CRITIC_METRICS, "tokens")], dtype=torch.float64)
    total = dp_sum(local).float()
    total = broadcast_from_last_stage(total if is_output_stage() else None, tuple(total.shape))
    return {"critic/vf_loss": float(total[0]), "critic/vf_clipfrac": float(total[1]) / max(float(total[2]), 1.0)}


class ValueEngine(MegatronEngine):
    """One rank of a Megatron value model: values, PPO value updates, HF backbone weights in."""

    def __init__(
        self,
        *,
        hf_config: dict,
        weights=None,
        seed: int = 0,
        head_init_std: float = 0.0,
        params_dtype: str | torch.dtype | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        warmup_steps: int = 0,
        schedule: str = "constant",
        min_lr: float = 0.0,
        total_steps: int | None = None,
    ):
        """`weights`: an HF checkpoint dir, an HF state dict, or None (random backbone from `seed`).

        The LM head of `weights` is ignored; the value head is N(0, head_init_std) from `seed`
        (zeros by default), identical on every rank.
        """
        cpu_compat.install()
        self.hf_config = dict(hf_config)
        self.model = gpt.build_gpt(hf_config, params_dtype=params_dtype, value_head=True)
        self._load_backbone(weights, seed=seed)
        self._init_head(seed=seed, std=head_init_std)
        self._update_calls = 0
        self.train: TrainState = build_train_state(
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

    def _load_backbone(self, weights, *, seed: int) -> None:
        if weights is None:
            from megarl.models.layout import random_hf_state_dict

            weights = random_hf_state_dict(self.model.arch, seed=seed)
        elif not isinstance(weights, dict):
            weights = hf_weights.read_hf_checkpoint(weights)
        hf_weights.load_hf_state_dict(self.model, weights, backbone_only=True)

    def _init_head(self, *, seed: int, std: float) -> None:
        head = self.value_head
        if head is None:
            return
        generator = torch.Generator().manual_seed(seed + 7919)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
            head.bias.zero_()

    @property
    def value_head(self) -> gpt.ValueHead | None:
        """The head module on the last stage, None elsewhere."""
        head = getattr(self.model.chunks[-1], "output_layer", None)
        return head if isinstance(head, gpt.ValueHead) else None

    # ------------------------------------------------------------------ inference

    def compute_values(
        self,
        *,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        response_length: int,
        micro_batch_size: int,
        max_tokens_per_microbatch: int | None = None,
    ) -> Tensor:
        """Values [B, R] (float32 CPU, on every rank): V_t read at position P + t - 1 (module docstring).

        Values at response padding positions are meaningless (mask them).
        """
        cpu_compat.install()

        def loss_fn(mb, output):
            values = response_values(mb, output, response_length=response_length)
            return output.new_zeros(()), {"values": values.cpu()}

        return self._forward_rows(
            {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            loss_fn=loss_fn,
            shapes={"values": (input_ids.shape[0], response_length)},
        )["values"]

    # ------------------------------------------------------------------ training

    def update_critic(
        self,
        *,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        response_mask: Tensor,
        values: Tensor,
        returns: Tensor,
        ppo_epochs: int = 1,
        mini_batch_size: int | None = None,
        micro_batch_size: int = 8,
        shuffle: bool = True,
        seed: int = 0,
        cliprange_value: float = 0.5,
        loss_agg_mode: str = "token-mean",
        max_tokens_per_microbatch: int | None = None,
    ) -> dict[str, float]:
        """PPO value epochs x (shuffled) mini-batches of this DP rank's share; one optimizer step each.

        `values` are the rollout-time values (the clipping anchor), `returns` the GAE targets,
        both [B, R]. Normalisation as in `PolicyEngine.update_policy` (global token counts).
        Returns the mean over mini-batches of critic/{vf_loss, vf_clipfrac, grad_norm, lr}.
        """
        cpu_compat.install()
        response_length = response_mask.shape[1]
        data = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask.float(),
            "values": values.float(),
            "returns": returns.float(),
        }
        loss_settings = dict(
            response_length=response_length, cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode
        )
        return self._epochs_of_mini_batches(
            data,
            ppo_epochs=ppo_epochs,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            shuffle=shuffle,
            seed=seed,
            step=lambda mini, micro: self._value_mini_batch(mini, micro, loss_settings),
        )

    def _value_mini_batch(self, mini: dict[str, Tensor], micro: MicroBatches, loss_settings: dict) -> dict[str, float]:
        loss_fn = functools.partial(
            critic_loss,
            scale=loss_scale(len(micro)),
            normalisers=global_normalisers(mini["response_mask"]),
            **loss_settings,
        )
        outputs, grad_norm, lr = self._optimizer_step(self.train, micro, loss_fn)
        return {**_reduce_critic_metrics(outputs), "critic/grad_norm": grad_norm, "critic/lr": lr}

    # ------------------------------------------------------------------ weights

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Replace the backbone with a full HF (policy) state dict; the value head is kept."""
        cpu_compat.install()
        hf_weights.load_hf_state_dict(self.model, state_dict, backbone_only=True)
        self.train.optimizer.reload_model_params()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, ckpt_dir: str | Path) -> Path:
        """Save weights, optimizer and LR schedule to `ckpt_dir`; collective (see `checkpoint`)."""
        return self._save_checkpoint(ckpt_dir, tokenizer_path=None)
