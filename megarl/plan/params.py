"""How many parameters one rank of a Megatron model holds, following Megatron's own sharding.

A rank holds `layers / (pp)` decoder layers (spread over its VPP chunks), each
parameter split along its TP dim (`megarl.models.layout.tp_split_dim`: QKV, fc1,
the vocab rows of the embedding and output layer are column-split, proj and fc2
row-split, norms and the MoE router replicated) and, in an MoE layer, `experts /
ep` whole experts (expert TP is 1). The first stage adds the embedding (vocab
padded to a multiple of 128 x TP), the last the final norm and the output layer:
the LM head, a copy of the tied embedding when PP > 1, or the value head of a
critic or reward model (hidden + 1, replicated). Counts are exact: the byte tests
compare them with the tensors megatron allocates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megarl.models.layout import OUTPUT, megatron_param_shapes, padded_vocab_size, tp_split_dim
from megarl.models.sharding import is_expert
from megarl.models.spec import Arch


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds: `dense` (sharded over DP by a distributed optimizer) and `expert` (over the
    expert-DP ranks)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def layer_params(arch: Arch, *, tp: int, ep: int) -> RankParams:
    """(dense, expert) parameters of one decoder layer on one (TP, EP) rank."""
    one_layer = dataclasses.replace(arch, num_layers=1)
    dense = expert = 0
    for name, shape in megatron_param_shapes(one_layer, padded_vocab=1).items():
        if not name.startswith("decoder.layers.0."):
            continue
        count = _numel(shape)
        if is_expert(name):
            expert += count
        else:
            dense += count // tp if tp_split_dim(name) is not None else count
    return RankParams(dense, expert // ep)


def stage_params(arch: Arch, *, tp: int, pp: int, ep: int = 1, pp_rank: int, value_head: bool = False) -> RankParams:
    """Parameters of PP stage `pp_rank` (all its VPP chunks: the same layers in total) on one TP/EP rank."""
    layer = layer_params(arch, tp=tp, ep=ep)
    layers = arch.num_layers // pp
    vocab_rows = padded_vocab_size(arch.vocab_size, tp_size=tp) // tp * arch.hidden_size
    dense = layers * layer.dense
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        dense += vocab_rows
    if last:
        dense += arch.hidden_size  # the final norm
        if value_head:
            dense += arch.hidden_size + 1
        elif not arch.tie_word_embeddings or not first:
            dense += vocab_rows  # the LM head, or the tied embedding's copy on the last stage
    return RankParams(dense, layers * layer.expert)


def rank_params(arch: Arch, *, tp: int, pp: int, ep: int = 1, value_head: bool = False) -> RankParams:
    """The largest stage's parameters per rank (the rank whose memory decides)."""
    stages = [stage_params(arch, tp=tp, pp=pp, ep=ep, pp_rank=rank, value_head=value_head) for rank in range(pp)]
    return max(stages, key=lambda stage: stage.total)


def model_params(arch: Arch, *, value_head: bool = False) -> int:
    """Parameters of the whole model (unpadded vocab): what one copy of the weights weighs."""
    shapes = megatron_param_shapes(arch, padded_vocab=arch.vocab_size)
    total = sum(_numel(shape) for shape in shapes.values())
    if value_head:
        total += arch.hidden_size + 1 - _numel(shapes.get(OUTPUT, (0,)))
    return total

