"""Training state of a trainable engine: DDP-wrapped chunks, megatron optimizer, LR schedule.

Megatron's DDP wrapper owns the gradient buffers (`param.main_grad`) and the DP
all-reduce; `finalize_model_grads` (called by the pipeline schedule after the last
backward) also all-reduces tied embedding grads between the first and last stage.
The optimizer is megatron's (`get_megatron_optimizer`; torch AdamW underneath without
TE/Apex, fp32 main params for bf16 models) with grad-norm clipping; the LR follows
megatron's `OptimizerParamScheduler` (linear warm-up, then constant/linear/cosine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.config.settings import OptimizerSettings

SCHEDULES = ("constant", "linear", "cosine")
# Megatron computes the grad norm only when clipping; a limit no norm reaches keeps
# the norm as a metric while never rescaling.
_NO_CLIP = 1.0e30


@dataclass
class TrainState:
    ddp_chunks: list[DistributedDataParallel]
    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: OptimizerParamScheduler

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers under megatron's wrapper (one per parameter group family when chained)."""
        return [inner.optimizer for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def has_state(self) -> bool:
        """Adam creates its moments at the first step; before that there is no state to save or offload."""
        return any(len(optimizer.state) > 0 for optimizer in self.torch_optimizers())

    def reset_state(self) -> None:
        """Forget Adam's moments; the next step starts them afresh (the LR schedule is kept)."""
        for optimizer in self.torch_optimizers():
            optimizer.state.clear()

    def zero_grad(self) -> None:
        for chunk in self.ddp_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[float, float]:
        """Advance the LR schedule, then one optimizer step (grads clipped); returns (grad_norm, lr used).

        The schedule advances first so optimizer step k runs with the warm-up LR of step k
        (k >= 1): the very first update is never a zero-LR no-op.
        """
        self.scheduler.step(increment=1)
        lr = self.optimizer.param_groups[0]["lr"]
        _, grad_norm, _ = self.optimizer.step()
        return float(grad_norm if grad_norm is not None else float("nan")), float(lr)

    def step_with_lr(self, lr: float) -> float:
        """One optimizer step at a fixed `lr` without advancing the schedule; returns the grad norm."""
        scheduled = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, grad_norm, _ = self.optimizer.step()
        for group, value in zip(self.optimizer.param_groups, scheduled):
            group["lr"] = value
        return float(grad_norm if grad_norm is not None else float("nan"))


def build_train_state(chunks: list[torch.nn.Module], config: TransformerConfig, settings: OptimizerSettings) -> TrainState:
    """Wrap `chunks` in DDP, build the optimizer and scheduler from `settings`, and hook them into `config`."""
    lr, weight_decay, clip_grad, min_lr = settings.lr, settings.weight_decay, settings.clip_grad, settings.min_lr
    schedule, warmup_steps, total_steps, betas = (settings.schedule, settings.warmup_steps, settings.total_steps,
                                                  settings.betas)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")
    if schedule != "constant" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(f"schedule={schedule!r} needs total_steps > warmup_steps (got {total_steps}, {warmup_steps})")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    # Grad reduction is not overlapped with compute: the DP all-reduce runs once, in
    # finalize_model_grads after the last micro-batch, so plain buckets suffice for VPP too.
    ddp_chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk) for chunk in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=min_lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=settings.eps,
            clip_grad=clip_grad if clip_grad > 0 else _NO_CLIP,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=False,
        ),
        ddp_chunks,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        # Megatron asserts warm-up < decay steps even for the constant style, which never decays.
        lr_decay_steps=total_steps if total_steps else warmup_steps + 1,
        lr_decay_style=schedule,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    config.grad_scale_func = optimizer.scale_loss
    return TrainState(ddp_chunks, optimizer, scheduler)
