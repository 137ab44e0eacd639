"""Settings for tests: the library's settings have no defaults (the recipe holds them), so the engine and
rollout tests build theirs here, naming only what a test varies."""

from __future__ import annotations

from megarl.config.settings import (
    Batching,
    OptimizerSettings,
    PolicyLossSettings,
    PolicyUpdateSettings,
    SamplingSettings,
    ValueUpdateSettings,
)

WHOLE_SHARD = 1 << 30  # a mini-batch size no test reaches: one optimizer step per update call
# A PPO loss with every term on (asymmetric clip, dual clip, entropy bonus, KL loss): what the engine tests check.
FULL_PPO_LOSS = dict(policy_loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                     loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                     kl_loss_type="low_var_kl")


def optimizer(*, lr: float = 0.0, clip_grad: float = 0.0, weight_decay: float = 0.0, warmup_steps: int = 0,
              schedule: str = "constant", total_steps: int = 1000) -> OptimizerSettings:
    return OptimizerSettings(lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8, clip_grad=clip_grad,
                             warmup_steps=warmup_steps, schedule=schedule, min_lr=0.0, total_steps=total_steps)


def batching(micro_batch_size: int, max_tokens: int | None = None) -> Batching:
    return Batching(micro_batch_size, max_tokens)


def policy_update(*, micro_batch_size: int, max_tokens: int | None = None, epochs: int = 1,
                  mini_batch_size: int = WHOLE_SHARD, shuffle: bool = False, seed: int = 0,
                  temperature: float = 1.0, **loss) -> PolicyUpdateSettings:
    """`loss` overrides the PPO loss fields (clip_ratio_low=..., loss_agg_mode=..., ...)."""
    fields = dict(policy_loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                  loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.001,
                  kl_loss_type="low_var_kl")
    fields.update(loss)
    return PolicyUpdateSettings(epochs=epochs, mini_batch_size=mini_batch_size,
                                batching=batching(micro_batch_size, max_tokens), shuffle=shuffle, seed=seed,
                                temperature=temperature, loss=PolicyLossSettings(**fields))


def value_update(*, micro_batch_size: int, max_tokens: int | None = None, epochs: int = 1,
                 mini_batch_size: int = WHOLE_SHARD, shuffle: bool = False, seed: int = 0,
                 cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean") -> ValueUpdateSettings:
    return ValueUpdateSettings(epochs=epochs, mini_batch_size=mini_batch_size,
                               batching=batching(micro_batch_size, max_tokens), shuffle=shuffle, seed=seed,
                               cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode)


def sampling(max_new_tokens: int, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
             stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False) -> SamplingSettings:
    """SGLang's own defaults (temperature 1, top-p and top-k off, no stop tokens) except what a test names."""
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
