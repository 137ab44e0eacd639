"""The remote environment against a local HTTP service that fails some calls on purpose.

Each episode lasts two turns: the service answers the first with a `user` message and a
per-turn reward of -0.1, the second with done and a reward of 1 + sample. By uid it
misbehaves: `flaky` answers 503 to its first /step (retried, then played), `slow` sleeps past
the timeout on its first /start (retried), `broken` always answers 500 to /step (fails after
the retries), `refused` gets 400 at /start and `garbled` a /step answer without `done` (both
fail at once, without retries). Failures name the uid and sample, as the remote reward's do.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.agent.chat import ChatSegments
from megarl.agent.env_base import EpisodeRow
from megarl.agent.envs.remote import RemoteEnvironment, RemoteEnvironmentError
from megarl.agent.episodes import play_all
from megarl.config.settings import EpisodeSettings
from megarl.data.tokenizer import load_tokenizer
from megarl.registry import ENVIRONMENTS, TOOL_CALL_FORMATS
from megarl.rollout.results import GenerationResult

RETRIES, TIMEOUT_S = 2, 1.0
TOKENIZER = load_tokenizer()


class Service:
    def __init__(self):
        self.attempts: Counter = Counter()
        self.episodes: dict[str, dict] = {}
        self.lock = threading.Lock()

    def reply(self, route: str, body: dict) -> tuple[int, dict | str]:
        uid = body["uid"] if route == "start" else self.episodes[body["episode_id"]]["uid"]
        kind = uid.split("-")[0]
        with self.lock:
            self.attempts[(route, uid)] += 1
            attempt = self.attempts[(route, uid)]
        if route == "start":
            if kind == "refused":
                return 400, "unknown data source"
            if kind == "slow" and attempt == 1:
                time.sleep(1.5 * TIMEOUT_S)
            episode_id = f"{uid}/{body['sample']}"
            self.episodes[episode_id] = {"uid": uid, "sample": body["sample"], "turns": 0}
            return 200, {"episode_id": episode_id}
        episode = self.episodes[body["episode_id"]]
        if route == "truncated":
            return 200, {"reward": 0.25}
        if kind == "flaky" and attempt == 1:
            return 503, "busy"
        if kind == "broken":
            return 500, "internal error"
        if kind == "garbled":
            return 200, {"messages": []}
        episode["turns"] += 1
        if episode["turns"] == 1:
            return 200, {"messages": [{"role": "user", "content": "go on"}], "reward": -0.1, "done": False}
        return 200, {"messages": [], "reward": 1.0 + episode["sample"], "done": True}


@pytest.fixture()
def service():
    state = Service()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, answer = state.reply(self.path.strip("/"), body)
            payload = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def _generate(ids, max_new_tokens, seed):
    out = TOKENIZER.encode("ok", add_special_tokens=False) + [TOKENIZER.eos_token_id]
    return GenerationResult(out, [-0.1] * len(out), "stop", "0")


def _play(url, uids, *, max_turns=4, on_truncation="fixed"):
    async def scenario():
        env = ENVIRONMENTS.get("remote").target(url=url, timeout_s=TIMEOUT_S, retries=RETRIES, backoff_s=0.05)
        rows = [EpisodeRow(uid, sample, "remote/task", [{"role": "user", "content": "hi"}], "x", {})
                for uid, sample in uids]
        prompt = TOKENIZER.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        try:
            return await play_all(rows, [prompt] * len(rows), seeds=[None] * len(rows), env=env,
                                  chat=ChatSegments(TOKENIZER, max_tokens=32),
                                  parse=TOOL_CALL_FORMATS.get("hermes").target.parse, generate=_generate,
                                  settings=EpisodeSettings(max_turns=max_turns, budget=200,
                                                           on_truncation=on_truncation, truncation_reward=0.0,
                                                           max_tokens_per_turn=None))
        finally:
            await env.close()

    return asyncio.run(scenario())


def test_episodes_play_through_retries(service):
    state, url = service
    trajectories = _play(url, [("ok-0", 0), ("ok-0", 1), ("flaky-1", 0), ("slow-2", 1)])
    assert [[reward for _, reward in t.rewards] for t in trajectories] == [[-0.1, 1.0], [-0.1, 2.0], [-0.1, 1.0],
                                                                           [-0.1, 2.0]]
    assert [segment.text for segment in trajectories[0].segments] == ["ok", "go on", "ok"]
    assert state.attempts[("step", "flaky-1")] == 3  # one 503, then two steps
    assert state.attempts[("start", "slow-2")] == 2  # one timeout, then started


@pytest.mark.parametrize("uid, route, attempts, message", [
    ("broken-1", "step", RETRIES + 1, f"HTTP 500: internal error after {RETRIES + 1} attempts"),
    ("refused-2", "start", 1, "HTTP 400: unknown data source"),
    ("garbled-3", "step", 1, "no boolean 'done'"),
])
def test_a_failing_episode_fails_the_call_naming_uid_and_sample(service, uid, route, attempts, message):
    state, url = service
    with pytest.raises(RemoteEnvironmentError) as error:
        _play(url, [("ok-0", 0), (uid, 1)])
    assert f"uid {uid} sample 1 at /{route}" in str(error.value) and message in str(error.value)
    assert state.attempts[(route, uid)] == attempts


def test_truncation_asks_the_service_when_the_recipe_says_so(service):
    _, url = service
    (trajectory,) = _play(url, [("ok-0", 0)], max_turns=1, on_truncation="environment")
    assert trajectory.truncated == "max_turns" and [reward for _, reward in trajectory.rewards] == [-0.1, 0.25]
