"""Megatron-core engines: the only package that imports megatron.core.

`distributed` sets up process groups, `gpt` builds GPT (incl. MoE) models from HF
configs with Transformer Engine or local layers, `hf_weights` moves HF weights in and
out (each rank reading only its slices of a checkpoint through `hf_reader`), `checkpoint`
saves/loads distributed checkpoints at any layout and `export` turns one into an HF
checkpoint, `offload` moves an engine's device memory to the host and back, `logprobs`
computes token log-probs/entropy from vocab-parallel logits, `packing` + `schedule`
build (packed) micro-batches and run megatron's pipeline schedule over them, `optim`
holds optimizer + LR schedule, `lora` puts tensor-parallel LoRA adapters on a frozen policy
(`lora_export` writes them as a PEFT adapter or merged), `actor.PolicyEngine` is the actor/reference and
`critic.ValueEngine` the critic, both on `engine_base.MegatronEngine` (micro-batching,
forward passes over rows, epochs of mini-batches, checkpoints).
On a CPU-only machine `cpu_compat` makes megatron run there; importing this package
installs its process-wide torch.cuda stubs first, so they precede every megatron import, then imports
megatron.core with `lazy_compile.deferred_compile` (its import-time torch.compile wrappers cost each rank ~3 s)
and `megatron_loggers.loggers_hidden` (its optional W&B and TensorBoard logging, unused here, ~1.5 s).
"""

import warnings

# Without transformer-engine and apex, megatron warns at import that it falls back
# to its local/torch implementations: that is the intended path here, not a fault.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|cuda_graph_scope).*")

from megarl.quiet import quiet_third_parties  # noqa: E402

quiet_third_parties()  # in each engine worker too: it inherits MEGARL_VERBOSE

from megarl.engines import cpu_compat  # noqa: E402  (after the filter, before any megatron import)

cpu_compat.install_stubs()

from megarl.engines.lazy_compile import deferred_compile  # noqa: E402
from megarl.engines.megatron_loggers import loggers_hidden  # noqa: E402

# Megatron's import builds torch.compile wrappers for kernels megarl never calls: built at first call instead.
# It also imports W&B and TensorBoard for a logging path megarl never takes.
with deferred_compile(), loggers_hidden():
    import megatron.core  # noqa: E402, F401
