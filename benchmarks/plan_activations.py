"""Benchmark: `megarl plan`'s activation bytes against the tensors autograd saves in one real actor update.

One rank (TP1, gloo, CPU, Megatron's local layer spec, float32) builds a policy engine for
a small Llama and runs one PPO update of one micro-batch of `--rows` x `--length` tokens,
every row full. A `saved_tensors_hooks` pair counts the distinct storages autograd keeps for
the backward pass (what activation memory is; the weights it also keeps are left out). The plan's figure
for the same shape (no flash attention: the local spec keeps the softmax output; float32
doubles every 16-bit term) is printed beside it, per micro-batch shape.

    python benchmarks/plan_activations.py
    python benchmarks/plan_activations.py --hidden 512 --layers 4 --lengths 64 256
"""

from __future__ import annotations

import argparse

import torch

from megarl.bench import Column, Report
from megarl.config.settings import Batching, PolicyLossSettings, PolicyUpdateSettings
from megarl.engines.distributed import init_distributed
from megarl.models.spec import arch_from_hf
from megarl.plan.memory import Layout, activation_bytes
from megarl.ports import free_port


def _saved_bytes(engine, rows: dict, settings: PolicyUpdateSettings) -> int:
    """Bytes of the distinct storages autograd saves during one update, the weights (saved for their matmuls'
    input gradients, but not activations) left out."""
    weights = {p.untyped_storage().data_ptr() for chunk in engine.model.chunks for p in chunk.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        engine.update(rows, settings)
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    from megarl.engines.actor import PolicyEngine

    hf_config = {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
                 "intermediate_size": args.hidden * 11 // 4, "num_hidden_layers": args.layers,
                 "num_attention_heads": args.hidden // 32, "num_key_value_heads": args.hidden // 64,
                 "max_position_embeddings": 4096, "tie_word_embeddings": False}
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp=1, pp=1)
    from megarl.config.settings import OptimizerSettings

    optim = OptimizerSettings(lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0,
                              warmup_steps=0, schedule="constant", min_lr=0.0, total_steps=10)
    engine = PolicyEngine(hf_config=hf_config, weights=None, seed=1, params_dtype="float32", transformer_impl="local",
                          optimizer=optim)
    loss = PolicyLossSettings(policy_loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                              loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                              kl_loss_type="low_var_kl")
    arch = arch_from_hf(hf_config)
    report = Report.create("plan-activations", {"hf_config": hf_config, "rows": args.rows})
    table = report.add_table("activations of one micro-batch", [
        Column("tokens"), Column("saved by autograd", "MiB", ".2f"), Column("plan", "MiB", ".2f"),
        Column("saved / plan", "", ".2f")])
    for length in args.lengths:
        prompt = length // 2
        generator = torch.Generator().manual_seed(length)
        ids = torch.randint(0, args.vocab, (args.rows, length), generator=generator)
        mask = torch.ones_like(ids)
        rows = {"input_ids": ids, "attention_mask": mask,
                "position_ids": torch.arange(length).expand(args.rows, length).clone(),
                "response_mask": mask[:, prompt:].clone(), "old_log_probs": torch.zeros(args.rows, length - prompt),
                "advantages": torch.randn(args.rows, length - prompt, generator=generator)}
        settings = PolicyUpdateSettings(epochs=1, mini_batch_size=args.rows, batching=Batching(args.rows, None),
                                        shuffle=False, seed=0, temperature=1.0, loss=loss)
        saved = _saved_bytes(engine, rows, settings)
        planned = activation_bytes(arch, layout=Layout(tp=1, pp=1, dp=1), micro_batch=args.rows, seq_len=length,
                                   microbatches=1, dtype="float32", flash=False, recompute="none", value_head=False)
        table.add_row(f"{args.rows} x {length}", saved / 2**20, planned / 2**20, saved / planned)
    print(report.to_markdown(with_settings=False))


if __name__ == "__main__":
    main()
