"""Episodes: token-exact trajectories, segments rendered by the chat template, rewards on their tokens, truncation.

The scripted generator answers with ids no tokenizer would produce for the text (one id per
character where the tokenizer merges characters), so any decode-and-encode in the loop would
change the trained ids and fail these tests.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from megarl.agent.chat import ChatSegments
from megarl.agent.env_base import Environment, EpisodeRow, Reply
from megarl.agent.envs.guessing import GuessingEnvironment
from megarl.agent.envs.tool_use import ToolUseEnvironment
from megarl.agent.episodes import play, play_all
from megarl.config.settings import EpisodeSettings
from megarl.agent.isolation import Limits
from megarl.agent.sandbox import SandboxPool
from megarl.agent.toolbox import ToolBox
from megarl.data.tokenizer import load_tokenizer
from megarl.registry import TOOL_CALL_FORMATS
from megarl.rollout.results import GenerationResult

TOKENIZER = load_tokenizer()
EOS = TOKENIZER.eos_token_id
PARSE = TOOL_CALL_FORMATS.get("hermes").target.parse
LIMITS = Limits(wall_s=5.0, cpu_s=5, memory_mb=512, max_output_bytes=65536, max_processes=32, max_file_mb=4)

# Qwen2.5's handling of tool messages: inside a user turn, each in <tool_response>, consecutive ones grouped.
QWEN_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role != 'tool' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def char_ids(text: str) -> list[int]:
    """One id per character: a valid but non-canonical tokenization of `text` (the tokenizer merges pairs)."""
    return [TOKENIZER.convert_tokens_to_ids(TOKENIZER.convert_ids_to_tokens(TOKENIZER.encode(ch))[0]) for ch in text]


class Scripted:
    """A generator that answers turn k of every episode with script[k] (text, as char ids, + EOS) and records the
    ids it was sent."""

    def __init__(self, script: list[str], *, delay_s: float = 0.0, eos: bool = True):
        self.script, self.delay_s, self.eos = script, delay_s, eos
        self.sent: list[tuple[list[int], int]] = []
        self.generated: list[list[int]] = []

    async def __call__(self, ids: list[int], max_new_tokens: int, seed: int | None) -> GenerationResult:
        await asyncio.sleep(self.delay_s)
        # This episode's earlier turns were sent prefixes of `ids` (one episode per script use).
        index = len([1 for previous, _ in self.sent if ids[: len(previous)] == previous])
        self.sent.append((list(ids), max_new_tokens))
        out = char_ids(self.script[min(index, len(self.script) - 1)]) + ([EOS] if self.eos else [])
        finish = "stop"
        if len(out) >= max_new_tokens:
            out, finish = out[:max_new_tokens], "length"
        self.generated.append(out)
        return GenerationResult(out, [-0.5] * len(out), finish, "0")


def row(truth="80235", question="12345+67890=?", uid="u0", sample=0) -> EpisodeRow:
    return EpisodeRow(uid, sample, "megarl/arithmetic", [{"role": "user", "content": question}], truth,
                      {"question": question})


def prompt_ids(question="12345+67890=?") -> list[int]:
    text = TOKENIZER.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return TOKENIZER.encode(text, add_special_tokens=False)


def settings(**overrides) -> EpisodeSettings:
    return EpisodeSettings(**{"max_turns": 4, "budget": 400, "on_truncation": "fixed", "truncation_reward": 0.0,
                              "max_tokens_per_turn": None, **overrides})


def test_segments_are_what_the_template_renders_after_the_turn():
    chat = ChatSegments(TOKENIZER, max_tokens=64)
    conversation = [{"role": "user", "content": "1+2=?"}, {"role": "assistant", "content": "call"},
                    {"role": "tool", "content": "3"}]
    whole = TOKENIZER.encode(TOKENIZER.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)
    pieces = (prompt_ids("1+2=?") + TOKENIZER.encode("call", add_special_tokens=False) + [EOS]
              + chat.encode([{"role": "tool", "content": "3"}], turn_ended_with_eos=True))
    assert pieces == whole
    assert TOKENIZER.decode(chat.encode([{"role": "tool", "content": "3"}], turn_ended_with_eos=False)) == \
        "<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"


def test_a_qwen_like_template_wraps_and_groups_tool_results(monkeypatch):
    tokenizer = load_tokenizer()
    monkeypatch.setattr(tokenizer, "chat_template", QWEN_LIKE_TEMPLATE)
    chat = ChatSegments(tokenizer, max_tokens=64)
    ids = chat.encode([{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}], turn_ended_with_eos=True)
    assert tokenizer.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4"
                                     "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_long_environment_message_is_shortened_to_max_tokens():
    chat = ChatSegments(TOKENIZER, max_tokens=8)
    long = " ".join(str(number) for number in range(200))
    assert chat.shorten(long).endswith(" ... [truncated]")
    assert len(TOKENIZER.encode(chat.shorten(long).removesuffix(" ... [truncated]"))) <= 9
    assert chat.shorten("short") == "short"


def _tool_episode(script, *, budget=400, max_turns=4, on_truncation="fixed", truncation_reward=0.0,
                  max_tool_tokens=64):
    async def scenario():
        pool = SandboxPool(tools=["calculator"], size=1, limits=LIMITS)
        await pool.start()
        try:
            box = ToolBox(pool, format=TOOL_CALL_FORMATS.get("hermes").target)
            env = ToolUseEnvironment(tools=box)
            generate = Scripted(script)
            trajectory = await play(
                row=row(), prompt_ids=prompt_ids(), env=env, chat=ChatSegments(TOKENIZER, max_tokens=max_tool_tokens),
                parse=PARSE, generate=generate, seed=3,
                settings=settings(budget=budget, max_turns=max_turns, on_truncation=on_truncation,
                                  truncation_reward=truncation_reward))
            return trajectory, generate, box.metrics_since(({}, 0))
        finally:
            await pool.close()

    return asyncio.run(scenario())


CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"12345+67890"}}</tool_call>'


def test_a_tool_episode_is_token_exact_and_rewarded_on_the_last_model_token():
    trajectory, generate, metrics = _tool_episode([CALL, "#### 80235"])
    # Each turn was sent the previous turn's ids plus what came since; the first turn the prompt.
    (first, _), (second, _) = generate.sent
    assert first == prompt_ids()
    assert second[: len(first)] == first and second[len(first): len(first) + len(generate.generated[0])] == \
        generate.generated[0]
    # The trained ids are the generated ids, interleaved with the tool's segment.
    mask = trajectory.mask
    model_ids = [token for token, bit in zip(trajectory.response_ids, mask) if bit]
    assert model_ids == generate.generated[0] + generate.generated[1]
    tool_ids = [token for token, bit in zip(trajectory.response_ids, mask) if not bit]
    assert TOKENIZER.decode(tool_ids) == "\n<|im_start|>tool\n80235<|im_end|>\n<|im_start|>assistant\n"
    assert trajectory.prompt_ids + trajectory.response_ids == second + generate.generated[1]
    assert trajectory.logprobs == [-0.5 if bit else 0.0 for bit in mask]
    assert trajectory.rewards == [(len(mask) - 1, 1.0)] and trajectory.truncated is None and trajectory.turns == 2
    assert [segment.who for segment in trajectory.segments] == ["assistant", "tool", "assistant"]
    assert metrics["tool/calculator/calls"] == 1 and metrics["tool/calculator/errors"] == 0


def test_a_malformed_call_is_answered_with_an_error_and_counted():
    trajectory, generate, metrics = _tool_episode(['<tool_call>{"name": calculator}</tool_call>', "#### 1"])
    assert trajectory.segments[1].text.startswith("Error: malformed tool call: the call is not valid JSON")
    assert metrics["multi_turn/invalid_tool_calls"] == 1 and metrics["tool/calculator/calls"] == 0
    assert trajectory.rewards[-1][1] == 0.0


@pytest.mark.parametrize("on_truncation, truncation_reward, expected", [("fixed", -1.0, -1.0),
                                                                        ("environment", 0.0, 0.0)])
def test_running_out_of_turns_is_truncation_with_the_recipe_rule(on_truncation, truncation_reward, expected):
    trajectory, generate, _ = _tool_episode([CALL], max_turns=2, on_truncation=on_truncation,
                                            truncation_reward=truncation_reward)
    assert trajectory.truncated == "max_turns" and trajectory.turns == 2
    # The reply to the last turn would never be read: the response ends with the model's tokens.
    assert trajectory.mask[-1] == 1 and [s.who for s in trajectory.segments] == ["assistant", "tool", "assistant"]
    assert trajectory.rewards == [(len(trajectory.mask) - 1, expected)]


def test_the_budget_cuts_a_turn_and_the_environment_scores_what_is_there():
    # 30 tokens: the call alone is longer, so the first turn is cut by the budget.
    trajectory, generate, _ = _tool_episode(["#### 80235 and more words than the budget has room for"],
                                            budget=30, on_truncation="environment")
    assert trajectory.truncated == "budget" and len(trajectory.response_ids) == 30
    assert generate.sent[0][1] == 30
    assert trajectory.rewards == [(29, 1.0)]  # the environment scores the cut turn: its answer is there


def test_a_reply_that_does_not_fit_the_budget_ends_the_episode():
    call_tokens = len(char_ids(CALL)) + 1
    trajectory, _, _ = _tool_episode([CALL, "#### 80235"], budget=call_tokens + 5)
    assert trajectory.truncated == "budget" and trajectory.mask == [1] * call_tokens


class _Recorder(Environment):
    """Replies to every turn with a fixed message, rewarding each turn by its number (per-turn rewards)."""

    async def step(self, episode, turn):
        return Reply([{"role": "user", "content": f"again {turn.number}"}], reward=float(turn.number),
                     done=turn.number == 3)


def test_per_turn_rewards_sit_on_each_turns_last_token():
    generate = Scripted(["a", "bc", "def"])
    trajectory = asyncio.run(play(row=row(), prompt_ids=prompt_ids(), env=_Recorder(),
                                  chat=ChatSegments(TOKENIZER, max_tokens=64), parse=PARSE, generate=generate,
                                  settings=settings(), seed=None))
    ends, position = [], 0
    for segment in trajectory.segments:
        position += segment.tokens
        if segment.who == "assistant":
            ends.append(position - 1)
    assert trajectory.rewards == [(ends[0], 1.0), (ends[1], 2.0), (ends[2], 3.0)]


def test_guessing_by_bisection_finds_the_secret_with_a_penalty_per_wrong_guess():
    env = GuessingEnvironment(step_penalty=0.1)
    game_row = EpisodeRow("g", 0, "megarl/guessing", [], "37", {})
    guesses = env.demonstration(game_row)
    assert guesses[-1] == "37" and len(guesses) <= 7
    trajectory = asyncio.run(play(row=game_row, prompt_ids=prompt_ids("guess"), env=env,
                                  chat=ChatSegments(TOKENIZER, max_tokens=64), parse=PARSE,
                                  generate=Scripted(guesses), settings=settings(max_turns=10), seed=None))
    rewards = [reward for _, reward in trajectory.rewards]
    assert rewards == pytest.approx([-0.1] * (len(guesses) - 1) + [1.0])
    hints = [segment.text for segment in trajectory.segments if segment.who == "user"]
    assert hints == ["higher" if int(g) < 37 else "lower" for g in guesses[:-1]]


def test_one_slow_tool_holds_up_only_its_own_episode():
    class SlowFirst(Environment):
        async def step(self, episode, turn):
            if episode.uid == "slow":
                await asyncio.sleep(1.5)
            return Reply(reward=1.0, done=True)

    finished: list[tuple[str, float]] = []
    rows = [row(uid="slow")] + [row(uid=f"fast{index}") for index in range(7)]
    started = time.perf_counter()

    def on_done(index, trajectory):
        finished.append((rows[index].uid, time.perf_counter() - started))

    trajectories = asyncio.run(play_all(rows, [prompt_ids()] * 8, seeds=[None] * 8, on_done=on_done, env=SlowFirst(),
                                        chat=ChatSegments(TOKENIZER, max_tokens=64), parse=PARSE,
                                        generate=Scripted(["x"], delay_s=0.05), settings=settings()))
    assert len(trajectories) == 8 and finished[-1][0] == "slow"
    assert max(seconds for uid, seconds in finished if uid != "slow") < 1.0


def test_misbehaving_tools_inside_episodes_are_contained_and_every_episode_ends():
    """One batch of episodes whose calls hang, exhaust memory, fork without end, print 100 MB, raise, or are
    malformed: each model reads why, the batch completes, and the counters say what happened."""
    programs = {
        "hang": "import time\ntime.sleep(60)",
        "memory": "x = bytearray(2 << 30)",
        "fork": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "flood": "import sys\nsys.stdout.write('y' * 100_000_000)",
        "raise": "raise ValueError('no')",
    }
    call = '<tool_call>{"name":"python","arguments":{"code":%s}}</tool_call>'
    scripts = [[call % json.dumps(code), "#### 1"] for code in programs.values()]
    scripts.append(['<tool_call>{"name":"python","arguments":{"code":1}</tool_call>', "#### 1"])  # bad JSON

    async def scenario():
        pool = SandboxPool(tools=["python"], size=2, limits=Limits(wall_s=2.0, cpu_s=1, memory_mb=512,
                                                                   max_output_bytes=65536, max_processes=32,
                                                                   max_file_mb=4))
        await pool.start()
        try:
            box = ToolBox(pool, format=TOOL_CALL_FORMATS.get("hermes").target)
            before = box.snapshot()
            env = ToolUseEnvironment(tools=box)
            episodes = [play(row=row(truth="1", uid=f"u{index}"), prompt_ids=prompt_ids(), env=env,
                             chat=ChatSegments(TOKENIZER, max_tokens=64), parse=PARSE, generate=Scripted(script),
                             settings=settings(), seed=None) for index, script in enumerate(scripts)]
            return await asyncio.gather(*episodes), box.metrics_since(before)
        finally:
            await pool.close()

    trajectories, metrics = asyncio.run(scenario())
    replies = [trajectory.segments[1].text for trajectory in trajectories]
    assert replies[0] == "Error: the tool ran longer than 2 s and was stopped"
    assert replies[1] == "Error: the tool needed more than 512 MB of memory"
    assert replies[2].startswith("Error: the tool") and "stopped" in replies[2]
    assert replies[3] == "Error: the tool printed more than 65536 bytes and was stopped"
    assert replies[4] == "Error: ValueError: no"
    assert replies[5].startswith("Error: malformed tool call: the call is not valid JSON")
    # Every episode went on to its answer and was rewarded.
    assert [[reward for _, reward in t.rewards] for t in trajectories] == [[1.0]] * 6
    assert metrics["tool/python/calls"] == 5 and metrics["tool/python/errors"] == 5
    assert metrics["tool/python/timeouts"] == 2 and metrics["multi_turn/invalid_tool_calls"] == 1
