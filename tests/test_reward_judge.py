"""The LLM judge: parsers, the visible handling of unreadable verdicts, the judge's message, and verdicts generated
by a real judge fleet (megarl's CPU engine speaking SGLang's protocol) through the reward loop.

The judge model is a tiny Llama rigged to always answer the digit "7": every token
embeds to the same direction, the layers add nothing, and the LM head's row of "7"
is the only one aligned with it, so greedy decoding is known without a trained model.
"""

from __future__ import annotations

import numpy as np
import pytest
from _settings import sampling
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megarl.controller.judge import JudgeScorer
from megarl.controller.reward_loop import ModelSide, RewardLoop
from megarl.data.padding import left_pad, position_ids_from_mask
from megarl.protocol import Batch
from megarl.rewards.judge import (
    judge_message,
    parse_fraction,
    parse_last_number,
    parse_score_tag,
    parse_yes_no,
    read_verdicts,
)
from megarl.rewards.manager import RewardManager
from megarl.rewards.registry import build_scorers
from megarl.rollout import RolloutFleet, ServerSpec
from megarl.rollout.results import GenerationResult

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nReference: {ground_truth}\nGrade 0-10."


def test_parsers():
    # A fraction is neither of its numbers: "7/10" is a parse failure unless `fraction` is asked for.
    assert parse_last_number("the answer is fine, 7/10") is None
    assert parse_last_number("the answer is fine, 7 / 10.") is None
    assert parse_last_number("right in 1/2 of the steps; grade 8") == 8.0
    assert parse_last_number("Score: 8.5") == 8.5 and parse_last_number("no digits") is None
    assert parse_fraction("the answer is fine, 7/10") == pytest.approx(0.7)
    assert parse_fraction("3/4 right, so 9 / 12 overall; 8") == pytest.approx(0.75)
    assert parse_fraction("8") is None and parse_fraction("1/0") is None
    assert parse_score_tag("think... <score> 3 </score> <score>6</score>") == 6.0
    assert parse_score_tag("6") is None and parse_score_tag("<score>7/10</score>") is None
    assert parse_yes_no("Is it right? No. Well, yes.") == 1.0 and parse_yes_no("NO") == 0.0
    assert parse_yes_no("maybe") is None


def test_unreadable_and_out_of_range_verdicts_get_the_fail_score_and_are_marked():
    verdicts = read_verdicts(["7", "I refuse", "42", "-1", "10"], parser="last_number", score_range=(0.0, 10.0),
                             fail_score=-5.0)
    assert verdicts.scores == [7.0, -5.0, -5.0, -5.0, 10.0]
    assert verdicts.failed == [False, True, True, True, False]


def test_the_tagged_form_is_the_default_parser():
    from megarl.config.reward import JudgeConfig

    assert JudgeConfig(model_path="/j", prompt_template="{response}").parser == "score_tag"
    verdicts = read_verdicts(["<score>7</score>", "7/10", "7"], parser="score_tag", score_range=(0.0, 10.0),
                             fail_score=0.0)
    assert verdicts.scores == [7.0, 0.0, 0.0] and verdicts.failed == [False, True, True]


def test_the_judge_message_is_the_template_over_the_row():
    message = judge_message(TEMPLATE, prompt=[{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "2+2?"}],
                            response="#### 4", ground_truth="4", data_source="openai/gsm8k")
    assert message == "Question: 2+2?\nAnswer: #### 4\nReference: 4\nGrade 0-10."


@pytest.fixture(scope="module")
def judge_fleet(tokenizer, tmp_path_factory):
    seven = tokenizer.convert_tokens_to_ids("7")
    config = LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[seven, 0] = 10.0
    path = tmp_path_factory.mktemp("judge") / "judge"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    spec = ServerSpec(backend="cpu", model_path=str(path), tokenizer_path=str(path),
                      log_dir=str(tmp_path_factory.mktemp("judge-logs")), api_key="judge-key")
    fleet = RolloutFleet(spec, num_servers=1, pad_token_id=tokenizer.pad_token_id, use_ray=False)
    yield fleet, tokenizer
    fleet.shutdown()


def _row_batches(tokenizer, rows: int):
    messages = [[{"role": "user", "content": f"{i}+1=?"}] for i in range(rows)]
    ids = tokenizer([tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages],
                    add_special_tokens=False)["input_ids"]
    input_ids, mask = left_pad(ids, tokenizer.pad_token_id)
    gen = Batch.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)})
    batch = Batch.from_dict({"raw_prompt": messages, "data_source": ["openai/gsm8k"] * rows,
                             "reward_model": [{"ground_truth": str(i + 1)} for i in range(rows)],
                             "extra_info": [{} for _ in range(rows)], "uid": [f"u{i}" for i in range(rows)]})
    return batch, gen


@pytest.mark.dist
def test_judge_fleet_verdicts_through_the_reward_loop(judge_fleet):
    fleet, tokenizer = judge_fleet
    outcomes = {}
    # "7" is a readable grade in 0..10 and out of range in 0..5: a parse failure, scored 0 and counted.
    for score_range in ((0.0, 10.0), (0.0, 5.0)):
        judge = JudgeScorer(fleet, tokenizer, template=TEMPLATE, parser="last_number", score_range=score_range,
                            fail_score=score_range[0],
                            sampling=sampling(1, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,)))
        loop = RewardLoop(manager=RewardManager(tokenizer, build_scorers()), tokenizer=tokenizer, combine="rm",
                          combine_options={}, model_side=ModelSide(judge=judge))
        batch, gen = _row_batches(tokenizer, 4)
        run = loop.begin(batch, gen)
        responses = [tokenizer.encode(f"#### {i + 1}", add_special_tokens=False) + [tokenizer.eos_token_id]
                     for i in range(4)]
        for rows in ([0, 1], [2, 3]):
            run.add(rows, [GenerationResult(responses[r], None, "stop", "0") for r in rows])
        mask = torch.ones(4, 5)
        out, metrics = run.finish(Batch.from_dict({"response_mask": mask}), rows=np.arange(4))
        loop.close()
        outcomes[score_range] = (out["token_level_scores"].sum(-1).tolist(), metrics["reward/judge_parse_fail"],
                                 run.verdicts)
    assert outcomes[(0.0, 10.0)] == ([7.0] * 4, 0, ["7"] * 4)
    assert outcomes[(0.0, 5.0)] == ([0.0] * 4, 4, ["7"] * 4)
