"""RewardModelEngine: one rank of a Megatron reward model (the GPT backbone plus a scalar score head).

The model is an HF `*ForSequenceClassification` with one label: the backbone, then
`score.weight` [1, H] (no bias) applied to the final-norm hidden state, read at the
pooling token of each row. That token follows HF's rule
(`GenericForSequenceClassification.forward` in transformers' `modeling_layers.py`):
the rightmost token whose id is not the config's `pad_token_id`, among the attended
positions here (megarl's own padding may use any id). So where the pad id is EOS, as
in many Llama-3-style reward models, an EOS-terminated row is read at its last token
before the EOS. Without a pad id it is the last attended token (where HF reads the
last position).
It is built like the value model (`gpt.build_gpt(value_head=True)`) with the head
swapped for the bias-free `ScoreHead`, replicated over TP. A reward model has no LM
head, so its backbone maps as a tied model does (no `lm_head.weight`).

`compute_scores` scores rows; `update` fits the model to preference pairs with the
Bradley-Terry loss -log sigmoid(s(chosen) - s(rejected) - margin) (margin 0 unless the
pairs give one, as TRL's `RewardTrainer.compute_loss` and OpenRLHF's `PairWiseLoss`),
normalised by the pairs of the whole mini-batch over DP, so the gradient does not
depend on the micro-batch split.
Weights come from an RM checkpoint (backbone and head) or from any HF checkpoint of
the family (backbone only; the head then starts at zero, so every first score is 0).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megarl.config.settings import Batching, OptimizerSettings, PreferenceUpdateSettings
from megarl.engines import cpu_compat, hf_reader, hf_weights
from megarl.engines.engine_base import SEQUENCE_KEYS, MegatronEngine, pick
from megarl.engines.gpt import GPTModelChunks
from megarl.engines.losses import dp_sum, loss_scale
from megarl.engines.protocol import Rows
from megarl.engines.schedule import MicroBatches, broadcast_from_last_stage, is_output_stage
from megarl.models.layout import SCORE_HEAD

Tensor = torch.Tensor
PAIR_KEYS = tuple(f"{side}_{key}" for side in ("chosen", "rejected") for key in SEQUENCE_KEYS)
RM_METRICS = ("rm/loss", "rm/accuracy", "rm/margin")


class ScoreHead(torch.nn.Module):
    """hidden [s, b, h] -> ([s, b, 1], None): HF's `score` linear (no bias), called like the LM output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))

    def forward(self, hidden_states: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight), None


def _last_true(mask: Tensor) -> Tensor:
    """Per row of a bool [n, L], the index of its last True."""
    return mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)


def pooled_scores(mb: dict, output: Tensor, *, pad_token_id: int | None) -> Tensor:
    """Scores [n] at the pooling token of each row (module docstring), from the model output [b, T, 1]
    (packed: [1, T, 1], rows located through `token_index`). A row whose attended tokens are all `pad_token_id`
    falls back to its last attended token."""
    scores = output.squeeze(-1).float()
    if "token_index" not in mb:
        attended, ids = mb["attention_mask"].bool(), mb["input_ids"]
    else:
        index = mb["token_index"]
        attended, ids = index >= 0, mb["input_ids"][0][index.clamp(min=0)]
    candidates = attended if pad_token_id is None else attended & (ids != pad_token_id)
    candidates = torch.where(candidates.any(-1, keepdim=True), candidates, attended)
    last = _last_true(candidates).unsqueeze(1)
    if "token_index" not in mb:
        return scores.gather(1, last.to(scores.device)).squeeze(1)
    return scores[0][mb["token_index"].gather(1, last).squeeze(1).to(scores.device)]


def _score_weight(weights) -> Tensor | None:
    """`score.weight` of an HF checkpoint dir or state dict; None for random weights or a plain backbone."""
    if weights is None:
        return None
    if isinstance(weights, dict):
        return weights.get(SCORE_HEAD)
    return hf_reader.read_tensor(weights, SCORE_HEAD)


def backbone_config(hf_config: dict) -> dict:
    """The config the engine builds from: a reward model has no LM head, which the layout maps express as tied."""
    return {**hf_config, "tie_word_embeddings": True}


def attach_score_head(model: GPTModelChunks) -> None:
    """Swap the value head a `value_head=True` build put on the last stage for the bias-free `ScoreHead`."""
    last = model.chunks[-1]
    if isinstance(getattr(last, "output_layer", None), torch.nn.Module):
        last.output_layer = ScoreHead(model.arch.hidden_size, model.config.params_dtype)
        if torch.cuda.is_available():
            last.output_layer.cuda(torch.cuda.current_device())


def interleave_pairs(rows: Rows) -> dict[str, Tensor]:
    """Chosen and rejected sequences as one batch [c0, r0, c1, r1, ...], right-padded to a common width, with
    each pair's `margin` on both of its rows."""
    width = max(rows[f"{side}_input_ids"].shape[1] for side in ("chosen", "rejected"))
    out = {}
    for key in SEQUENCE_KEYS:
        sides = [rows[f"{side}_{key}"] for side in ("chosen", "rejected")]
        sides = [F.pad(t, (0, width - t.shape[1])) for t in sides]
        out[key] = torch.stack(sides, dim=1).reshape(-1, width)
    out["margin"] = rows["margin"].float().repeat_interleave(2)
    return out


def bradley_terry_loss(mb: dict, output: Tensor, *, scale: int, pairs: float,
                       pad_token_id: int | None) -> tuple[Tensor, dict]:
    """One micro-batch's share of the mini-batch loss (rows alternate chosen, rejected), scaled by `scale`:
    -log sigmoid(s_c - s_r - margin) per pair. `rm/margin` is the mean score gap s_c - s_r (TRL's metric)."""
    scores = pooled_scores(mb, output, pad_token_id=pad_token_id)
    gap = scores[0::2] - scores[1::2]
    valid = mb["valid_row"][0::2].to(gap.device)
    loss = -(F.logsigmoid(gap - mb["margin"][0::2].to(gap.device)) * valid).sum() / pairs
    return loss * scale, {"rm/loss": loss.detach(), "rm/accuracy": ((gap > 0).float() * valid).sum().detach(),
                          "rm/margin": (gap * valid).sum().detach()}


def _reduce_rm_metrics(outputs: list[dict], pairs: float) -> dict[str, float]:
    """The mini-batch's loss (sum of micro-batch shares), accuracy and mean margin over DP, on every stage."""
    local = torch.zeros(len(RM_METRICS), dtype=torch.float64)
    for info in outputs:  # empty on stages without the head
        local += torch.tensor([float(info[name]) for name in RM_METRICS], dtype=torch.float64)
    total = dp_sum(local).float()
    total = broadcast_from_last_stage(total if is_output_stage() else None, tuple(total.shape))
    return {"rm/loss": float(total[0]), "rm/accuracy": float(total[1]) / pairs, "rm/margin": float(total[2]) / pairs}


class RewardModelEngine(MegatronEngine):
    """One rank of a Megatron reward model: scores, Bradley-Terry updates, HF weights with `score.weight`."""

    _backbone_only = True
    head = "score"

    def __init__(
        self,
        *,
        hf_config: dict,
        weights=None,
        seed: int,
        params_dtype: str | torch.dtype | None,
        transformer_impl: str,
        optimizer: OptimizerSettings | None,
    ):
        """`weights`: an HF checkpoint dir or state dict (with `score.weight`: a reward model; without: a
        backbone, the head starts at zero), or None (random backbone from `seed`, zero head).
        `hf_config["pad_token_id"]` sets the pooling token (the one the written checkpoint states).
        `optimizer=None` builds a frozen scorer."""
        self._build(backbone_config(hf_config), params_dtype=params_dtype, transformer_impl=transformer_impl,
                    value_head=True)
        self.pad_token_id = hf_config.get("pad_token_id")  # the pooling rule's pad id (module docstring)
        attach_score_head(self.model)
        self.train = None  # weights first: the optimizer takes its copies of them
        hf_weights.load_hf_weights(self.model, weights, seed=seed, backbone_only=True)
        self._load_score_head(_score_weight(weights))
        self._attach_optimizer(optimizer)

    @property
    def score_head(self) -> ScoreHead | None:
        """The head on the last pipeline stage, None elsewhere."""
        head = getattr(self.model.chunks[-1], "output_layer", None)
        return head if isinstance(head, ScoreHead) else None

    # ------------------------------------------------------------------ weights

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Backbone and `score.weight` in HF names, float32 CPU, on every rank (collective over TP and PP)."""
        state = super().hf_state_dict()
        head = self.score_head
        weight = head.weight.detach().float() if head is not None else None
        state[SCORE_HEAD] = broadcast_from_last_stage(weight, (1, self.model.arch.hidden_size)).cpu()
        return state

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """The backbone of `state_dict`, and its `score.weight` when it has one (else the head is zeroed)."""
        cpu_compat.install()
        hf_weights.load_hf_state_dict(self.model, state_dict, backbone_only=True)
        self._load_score_head(state_dict.get(SCORE_HEAD))
        if self.train is not None:
            self.train.optimizer.reload_model_params()

    def _load_score_head(self, score: Tensor | None) -> None:
        """The head on the last stage <- `score` [1, H], or zeros when the source has no head."""
        head = self.score_head
        if head is None:
            return
        if score is not None and tuple(score.shape) != tuple(head.weight.shape):
            raise ValueError(f"{SCORE_HEAD}: shape {tuple(score.shape)}, the reward model needs "
                             f"{tuple(head.weight.shape)} (one label)")
        with torch.no_grad():
            head.weight.copy_(score if score is not None else torch.zeros_like(head.weight))

    # ------------------------------------------------------------------ inference

    def compute_scores(self, rows: Rows, *, batching: Batching) -> Tensor:
        """Scores [B] (float32 CPU, on every rank) at the pooling token of each row."""

        def loss_fn(mb, output):
            return output.new_zeros(()), {"scores": pooled_scores(mb, output, pad_token_id=self.pad_token_id).cpu()}

        shape = (rows["input_ids"].shape[0],)
        return self._forward_rows(rows, batching=batching, loss_fn=loss_fn, shapes={"scores": shape})["scores"]

    # ------------------------------------------------------------------ training

    def update(self, rows: Rows, settings: PreferenceUpdateSettings) -> dict[str, float]:
        """Bradley-Terry epochs x (shuffled) mini-batches of this DP rank's pairs; one optimizer step each.

        `rows` holds `chosen_{input_ids,attention_mask,position_ids}` and the same for `rejected` ([N, S]), and
        optionally `margin` [N] (0 without). Returns the mean over mini-batches of rm/{loss, accuracy, margin,
        grad_norm, lr}.
        """
        train = self._require_trainable()
        data = pick(rows, PAIR_KEYS)
        data["margin"] = rows["margin"].float() if "margin" in rows else torch.zeros(len(data["chosen_input_ids"]))
        pair_batching = Batching(2 * settings.batching.micro_batch_size, None)

        def step(mini: dict[str, Tensor], micro: MicroBatches) -> dict[str, float]:
            pairs = float(dp_sum([mini["chosen_input_ids"].shape[0]])[0])
            loss_fn = functools.partial(bradley_terry_loss, scale=loss_scale(len(micro)), pairs=pairs,
                                        pad_token_id=self.pad_token_id)
            outputs, grad_norm, lr = self._optimizer_step(train, micro, loss_fn)
            return {**_reduce_rm_metrics(outputs, pairs), "rm/grad_norm": grad_norm, "rm/lr": lr}

        def whole_pairs(mini: dict[str, Tensor]) -> MicroBatches:
            # An even number of interleaved rows per micro-batch: a pair never straddles two.
            return self._micro_batches(interleave_pairs(mini), pair_batching)

        return self._epochs_of_mini_batches(data, settings, step, micro_batches=whole_pairs)
