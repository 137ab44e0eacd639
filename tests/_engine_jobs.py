"""Spawned engine jobs shared by several test modules, run at most once per pytest session.

Start-up (imports in fresh processes) dominates the engine tests on 2 cores: the layout
matrix job serves the forward/training and the packing tests, the checkpoint job's
TP2xPP2 checkpoint also serves the export tests.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

from _engine_spawn import run_spawned
from _settings import FULL_PPO_LOSS
from _tiny import padded_sequences, tiny_model
from _engine_workers import checkpoint_outputs, matrix_outputs
from megarl.data.padding import position_ids_from_mask

# The families and their overrides of tests/_tiny.py's sizes; the first one also runs a PPO update per layout.
MATRIX_MODELS = {
    "qwen2": dict(num_hidden_layers=4, attn_implementation="eager"),
    "llama": dict(num_hidden_layers=4, attn_implementation="eager", rope_theta=5000.0),
    "qwen3": dict(num_hidden_layers=4, attn_implementation="eager"),
}
# All layouts run in one 4-process job (the layout is switched in place): DP fills the rest.
WORLD_SIZE = 4
LAYOUTS = {
    "tp1pp1": dict(tp=1, pp=1),
    "tp2pp1": dict(tp=2, pp=1),
    "tp1pp2": dict(tp=1, pp=2),
    "tp2pp2": dict(tp=2, pp=2),
    "pp2vpp2": dict(tp=1, pp=2, vpp=2),
}
PROMPT, RESPONSE, MATRIX_ROWS = 6, 7, 8
MATRIX_PPO = {**FULL_PPO_LOSS, "temperature": 0.8}


def _matrix_batch() -> dict:
    gen = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, 300, (MATRIX_ROWS, PROMPT + RESPONSE), generator=gen)
    mask = torch.ones(MATRIX_ROWS, PROMPT + RESPONSE, dtype=torch.long)
    pads = [(0, 0), (2, 3), (5, 0), (1, 6), (3, 1), (0, 5), (4, 2), (2, 0)]
    for row, (left_pad, right_pad) in enumerate(pads):
        mask[row, :left_pad] = 0
        mask[row, PROMPT + RESPONSE - right_pad :] = 0
    position_ids = position_ids_from_mask(mask)
    loss_mask = mask.clone()
    loss_mask[:, :PROMPT] = 0
    response_mask = mask[:, PROMPT:].clone()
    noise = torch.randn(MATRIX_ROWS, RESPONSE, generator=gen)
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "response_mask": response_mask,
        # Log-probs of a near-uniform policy over 300 tokens, spread so some ratios clip.
        "old_log_probs": -5.7 + 0.3 * noise,
        "ref_log_prob": -5.7 + 0.2 * noise.flip(0),
        "advantages": torch.randn(MATRIX_ROWS, RESPONSE, generator=gen),
    }


@functools.cache
def matrix_job() -> dict:
    """HF models (random weights, randomised norms and biases) saved to a temp dir, the batch,
    and every rank's {layout: outputs} of `matrix_outputs` in one 4-process job."""
    root = Path(tempfile.mkdtemp(prefix="megarl-matrix-test-"))
    atexit.register(shutil.rmtree, root, True)
    models, checkpoints = {}, {}
    for name, overrides in MATRIX_MODELS.items():
        model = tiny_model(name, seed=len(name), **overrides)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name or param_name.endswith("bias"):
                    param.uniform_(0.5, 1.5)
        model.save_pretrained(root / name)
        models[name], checkpoints[name] = model, str(root / name)
    batch = _matrix_batch()
    out = run_spawned(
        matrix_outputs,
        world_size=WORLD_SIZE,
        layouts=LAYOUTS,
        checkpoints=checkpoints,
        batch=batch,
        response_length=RESPONSE,
        ppo=MATRIX_PPO,
    )
    return {"models": models, "checkpoints": checkpoints, "batch": batch, "out": out}


CKPT_PROMPT, CKPT_RESPONSE, CKPT_ROWS = 5, 6, 8
CKPT_PPO = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, entropy_coeff=0.0, temperature=1.0)
# Warm-up makes every step's LR depend on the restored schedule; Adam moments on the optimizer.
CKPT_TRAIN = dict(lr=1e-2, warmup_steps=4, clip_grad=1.0, weight_decay=0.01)


def _checkpoint_batch() -> dict:
    gen = torch.Generator().manual_seed(4)
    return {
        **padded_sequences(gen, rows=CKPT_ROWS, prompt=CKPT_PROMPT, response=CKPT_RESPONSE, vocab=200),
        "old_log_probs": -5.3 + 0.3 * torch.randn(CKPT_ROWS, CKPT_RESPONSE, generator=gen),
        "advantages": torch.randn(CKPT_ROWS, CKPT_RESPONSE, generator=gen),
    }


@functools.cache
def checkpoint_job() -> dict:
    """{"hf_dir", "ckpt_dir", "batch", "out": rank outputs} of `checkpoint_outputs` on 4 ranks."""
    from megarl.data.tokenizer import builtin_tokenizer_dir

    root = Path(tempfile.mkdtemp(prefix="megarl-ckpt-test-"))
    atexit.register(shutil.rmtree, root, True)
    tiny_model("qwen2", seed=8, vocab_size=200, num_hidden_layers=4).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(builtin_tokenizer_dir() / name, root / "hf" / name)
    batch = _checkpoint_batch()
    out = run_spawned(
        checkpoint_outputs,
        world_size=4,
        layout={"tp": 2, "pp": 2},
        checkpoint=str(root / "hf"),
        ckpt_dir=str(root / "ckpt"),
        batch=batch,
        ppo=CKPT_PPO,
        train=CKPT_TRAIN,
    )
    return {"hf_dir": root / "hf", "ckpt_dir": root / "ckpt", "batch": batch, "out": out}
