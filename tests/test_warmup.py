"""`megarl warmup`: the recipe's supervised warm-up alone, written as an HF checkpoint later runs start from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.cli import main

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"


@pytest.mark.e2e
@pytest.mark.dist
def test_the_warmed_policy_is_an_hf_checkpoint_of_the_recipes_model_and_differs_from_its_start(warmed_quickstart):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.config import load_recipe

    model_config = load_recipe(QUICKSTART).model.config
    written = json.loads((warmed_quickstart / "config.json").read_text())
    assert {key: written[key] for key in model_config} == model_config
    assert (warmed_quickstart / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(warmed_quickstart)  # HF reads it as it reads any checkpoint
    warmed = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    # The fixture's run dir keeps the random initial weights the warm-up started from.
    initial = load_file(str(warmed_quickstart.parent / "quickstart-grpo-cpu" / "hf_init" / "model.safetensors"))
    assert set(initial) <= set(warmed)
    # Trained: every tensor of the model moved (the warm-up updates all of them, embeddings included).
    assert all(not torch.equal(initial[name], warmed[name]) for name in initial)


def test_warmup_refuses_a_non_empty_output_dir_and_a_recipe_without_warm_up(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert main(["warmup", str(QUICKSTART), "--hf", str(taken), "--set", f"trainer.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --hf: {taken} exists and is not empty; choose a new directory"
    assert (taken / "keep.txt").read_text() == "mine"
    assert main(["warmup", str(QUICKSTART), "--hf", str(tmp_path / "new"), "--set", "sft_warmup.steps=0",
                 "--set", f"trainer.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip() == "error: sft_warmup.steps: the recipe has no warm-up to run (got 0)"
    assert not (tmp_path / "new").exists()
