"""Megatron-core engines: the only package that imports megatron.core.

`distributed` sets up process groups, `gpt` builds GPT models from HF configs and
moves HF weights in and out, `logprobs` computes token log-probs/entropy from
vocab-parallel logits, `schedule` runs megatron's pipeline schedule over micro-batches,
`optim` holds optimizer + LR schedule, and `actor.PolicyEngine` is the actor/reference.
On a CPU-only machine `cpu_compat` makes megatron run there; importing this package
installs its process-wide torch.cuda stubs first, so they precede every megatron import.
"""

from megarl.engines import cpu_compat

cpu_compat.install_stubs()
