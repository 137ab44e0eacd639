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

import torch

from megarl.algorithms.losses import value_loss
from megarl.config.settings import Batching, OptimizerSettings, ValueUpdateSettings
from megarl.engines import gpt, hf_weights
from megarl.engines.engine_base import SEQUENCE_KEYS, MegatronEngine, global_normalisers, pick
from megarl.engines.losses import dp_sum, loss_scale
from megarl.engines.protocol import Rows
from megarl.engines.schedule import MicroBatches, broadcast_from_last_stage, is_output_stage

Tensor = torch.Tensor
CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac")
UPDATE_KEYS = (*SEQUENCE_KEYS, "response_mask", "values", "returns")


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

    _backbone_only = True
    head = "value"

    def __init__(
        self,
        *,
        hf_config: dict,
        weights=None,
        seed: int,
        params_dtype: str | torch.dtype | None,
        transformer_impl: str,
        optimizer: OptimizerSettings,
        head_init_std: float = 0.0,
    ):
        """`weights`: an HF checkpoint dir, an HF state dict, or None (random backbone from `seed`).

        The LM head of `weights` is ignored; the value head is N(0, head_init_std) from `seed`
        (zeros by default: the first values are 0), identical on every rank.
        """
        self._build(hf_config, params_dtype=params_dtype, transformer_impl=transformer_impl, value_head=True)
        hf_weights.load_hf_weights(self.model, weights, seed=seed, backbone_only=True)
        self._init_head(seed=seed, std=head_init_std)
        self._attach_optimizer(optimizer)

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

    def compute_values(self, rows: Rows, *, batching: Batching) -> Tensor:
        """Values [B, R] (float32 CPU, on every rank): V_t read at position P + t - 1 (module docstring).

        Values at response padding positions are meaningless (mask them).
        """
        response_length = rows["responses"].shape[1]

        def loss_fn(mb, output):
            values = response_values(mb, output, response_length=response_length)
            return output.new_zeros(()), {"values": values.cpu()}

        shape = (rows["input_ids"].shape[0], response_length)
        return self._forward_rows(rows, batching=batching, loss_fn=loss_fn, shapes={"values": shape})["values"]

    # ------------------------------------------------------------------ training

    def update(self, rows: Rows, settings: ValueUpdateSettings) -> dict[str, float]:
        """PPO value epochs x (shuffled) mini-batches of this DP rank's rows; one optimizer step each.

        `values` are the rollout-time values (the clipping anchor), `returns` the GAE targets,
        both [B, R]. Normalisation as in `PolicyEngine.update` (global token counts).
        Returns the mean over mini-batches of critic/{vf_loss, vf_clipfrac, grad_norm, lr}.
        """
        data = pick(rows, UPDATE_KEYS, as_float=("response_mask", "values", "returns"))
        loss_settings = dict(response_length=data["response_mask"].shape[1], cliprange_value=settings.cliprange_value,
                             loss_agg_mode=settings.loss_agg_mode)

        def step(mini: dict[str, Tensor], micro: MicroBatches) -> dict[str, float]:
            loss_fn = functools.partial(
                critic_loss,
                scale=loss_scale(len(micro)),
                normalisers=global_normalisers(mini["response_mask"]),
                **loss_settings,
            )
            outputs, grad_norm, lr = self._optimizer_step(self.train, micro, loss_fn)
            return {**_reduce_critic_metrics(outputs), "critic/grad_norm": grad_norm, "critic/lr": lr}

        return self._epochs_of_mini_batches(data, settings, step)
