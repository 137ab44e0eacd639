"""`rollout.multi_turn` in a recipe: names resolve (user entries by Python path are imported), the environment
takes its options, and what a multi-turn run cannot do is refused with one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_recipe
from megarl.config.settings import multi_turn_settings
from megarl.errors import InputError

REPO = Path(__file__).resolve().parents[1]
TOOLS_RECIPE = REPO / "recipes" / "quickstart-tools-cpu.yaml"


def problems(*overrides: str) -> list[str]:
    with pytest.raises(InputError) as caught:
        load_recipe(TOOLS_RECIPE, list(overrides))
    return caught.value.problems


def test_the_tools_quickstart_and_its_baseline_without_tools():
    recipe = load_recipe(TOOLS_RECIPE)
    multi_turn = recipe.rollout.multi_turn
    assert (multi_turn.environment, multi_turn.tools, multi_turn.tool_call_format) == ("tool_use", ["calculator"],
                                                                                       "hermes")
    settings = multi_turn_settings(recipe)
    assert settings.episodes.budget == recipe.data.max_response_length
    assert (settings.episodes.max_turns, settings.tools, settings.sandbox.workers) == (3, ("calculator",), 2)
    baseline = load_recipe(TOOLS_RECIPE, ["rollout.multi_turn=null"])
    assert multi_turn_settings(baseline) is None and baseline.data == recipe.data and baseline.actor == recipe.actor


def test_user_entries_are_imported_by_python_path(tmp_path, monkeypatch):
    (tmp_path / "my_agent.py").write_text(
        "from megarl.agent.env_base import Environment, Reply\n"
        "class Echo(Environment):\n"
        "    def __init__(self, *, tools=None, greeting='hi'):\n"
        "        super().__init__(tools=tools)\n"
        "    async def step(self, episode, turn):\n"
        "        return Reply(reward=1.0, done=True)\n"
        "def shout(text):\n"
        "    return text.upper()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = load_recipe(TOOLS_RECIPE, ["rollout.multi_turn.environment=my_agent:Echo",
                                        "rollout.multi_turn.environment_options={greeting: hello}",
                                        "rollout.multi_turn.tools=[calculator, 'my_agent:shout']"])
    assert recipe.rollout.multi_turn.tools == ["calculator", "my_agent:shout"]
    assert problems("rollout.multi_turn.environment=my_agent:Echo",
                    "rollout.multi_turn.environment_options={colour: red}") == [
        "--set: rollout.multi_turn.environment_options: my_agent:Echo does not take them: got an unexpected keyword "
        "argument 'colour' (got {'colour': 'red'})"]


@pytest.mark.parametrize("overrides, expected", [
    (["rollout.multi_turn.environment=no_such_module:Env"],
     "rollout.multi_turn.environment: environment 'no_such_module:Env': cannot import module 'no_such_module'"),
    (["rollout.multi_turn.environment=labyrinth"], "unknown environment 'labyrinth'; known: guessing, remote, tool_use"),
    (["rollout.multi_turn.tools=[calculator, calculator]"], "two tools would have the same name: ['calculator']"),
    (["rollout.multi_turn.tools=['json:nothing']"], "tool 'json:nothing': module 'json' has no attribute 'nothing'"),
    (["rollout.multi_turn.tool_call_format=xml"], "unknown tool-call format 'xml'; known: hermes, qwen"),
    (["rollout.multi_turn.tools=[]"], "rollout.multi_turn.tools: environment 'tool_use' calls tools; name at least one"),
    (["rollout.ignore_eos=true"], "rollout.ignore_eos: a turn that never ends leaves no room for the next"),
    (["reward.remote={url: 'http://127.0.0.1:9/score'}"],
     "rollout.multi_turn.environment: with multi-turn episodes the environment gives the reward; remove "
     "reward.remote"),
    (["rollout.multi_turn.sandbox.wall_s=0"], "rollout.multi_turn.sandbox.wall_s"),
])
def test_what_a_multi_turn_run_refuses(overrides, expected):
    found = problems(*overrides)
    assert any(expected in line for line in found), found


def test_validate_names_the_key_and_exits_2():
    result = subprocess.run([sys.executable, "-m", "megarl", "validate", str(TOOLS_RECIPE), "--offline", "--set",
                             "rollout.multi_turn.environment=no_such_module:Env"], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "rollout.multi_turn.environment: environment 'no_such_module:Env'" in result.stderr


def test_warm_up_traces_are_played_with_the_tools_and_train_the_model_turns_only(tmp_path):
    from megarl.controller.multi_turn import Demonstrations
    from megarl.data.dataset import RLDataset, collate_prompts
    from megarl.data.synthetic import arithmetic_rows
    from megarl.data.tokenizer import load_tokenizer
    from megarl.protocol import Batch

    recipe = load_recipe(TOOLS_RECIPE, [f"trainer.output_dir={tmp_path}"])
    tokenizer = load_tokenizer()
    items = list(RLDataset(arithmetic_rows(3, seed=0, split="train", max_operand=99999), tokenizer,
                           max_prompt_length=48))
    demonstrations = Demonstrations(multi_turn_settings(recipe), tokenizer=tokenizer, run_dir=tmp_path / "run")
    try:
        batch = demonstrations.batch(Batch.from_dict(collate_prompts(items, tokenizer.pad_token_id)))
    finally:
        demonstrations.close()
    width = batch["input_ids"].shape[1] - recipe.data.max_response_length
    for row, item in enumerate(items):
        a, b = item["extra_info"]["question"].removesuffix("=?").split("+")
        call = ('<tool_call>{"name":"calculator","arguments":{"expression":"%s+%s"}}</tool_call>' % (a, b))
        answer = f"#### {int(a) + int(b)}"
        ids = batch["input_ids"][row, width:][batch["attention_mask"][row, width:].bool()].tolist()
        trained = batch["loss_mask"][row, width:][batch["attention_mask"][row, width:].bool()].bool().tolist()
        model = [token for token, bit in zip(ids, trained) if bit]
        tool = [token for token, bit in zip(ids, trained) if not bit]
        eos = [tokenizer.eos_token_id]
        assert model == tokenizer.encode(call, add_special_tokens=False) + eos + tokenizer.encode(answer) + eos
        assert tokenizer.decode(tool) == f"\n<|im_start|>tool\n{int(a) + int(b)}<|im_end|>\n<|im_start|>assistant\n"
        assert ids == model[: len(model) - len(tokenizer.encode(answer)) - 1] + tool + model[-len(
            tokenizer.encode(answer)) - 1:]
        assert not batch["loss_mask"][row, :width].any()  # the prompt is never trained on
