"""The remote reward against a local HTTP service that fails some calls on purpose.

The service scores a row as len(response) + 10 * sample and misbehaves by uid: it
answers 503 or times out on a row's first attempt (retried, then scored), always
answers 500 (fails after the retries), answers 400 or a body without a score (fail
at once, no retry). Checks: every row comes back exactly once with its own score,
the failing rows are named by uid and sample, retries and concurrency are bounded.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.rewards.remote import RemoteRewardClient, RemoteRewardError

MAX_CONCURRENCY, RETRIES, TIMEOUT_S = 3, 2, 1.0


class Service:
    def __init__(self):
        self.attempts: Counter = Counter()
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def reply(self, row: dict) -> tuple[int, str]:
        key = (row["uid"], row["sample"])
        with self.lock:
            self.attempts[key] += 1
            attempt = self.attempts[key]
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(0.05)  # long enough for requests to overlap
            kind = row["uid"].split("-")[0]
            if kind == "flaky" and attempt == 1:
                return 503, "busy"
            if kind == "slow" and attempt == 1:
                time.sleep(0.8 * TIMEOUT_S)
                with self.lock:  # the client gives up at TIMEOUT_S and frees its slot: no longer its request
                    self.in_flight -= 1
                time.sleep(0.7 * TIMEOUT_S)
                with self.lock:
                    self.in_flight += 1
            if kind == "broken":
                return 500, "internal error"
            if kind == "refused":
                return 400, "bad request"
            if kind == "garbled":
                return 200, json.dumps({"reward": 1.0})
            return 200, json.dumps({"score": len(row["response"]) + 10 * row["sample"], "note": "ignored"})
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture
def service():
    state = Service()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.headers["Authorization"] == "Bearer t0ken"
            status, body = state.reply(row)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on a slow answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def _row(uid: str, sample: int, response: str) -> dict:
    return {"uid": uid, "sample": sample, "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
            "response": response, "ground_truth": "7", "extra_info": {"index": 3}}


def _client(url: str) -> RemoteRewardClient:
    return RemoteRewardClient(url, max_concurrency=MAX_CONCURRENCY, timeout_s=TIMEOUT_S, retries=RETRIES,
                              backoff_s=0.05, headers={"Authorization": "Bearer t0ken"})


def test_every_row_comes_back_once_through_503s_and_timeouts(service):
    state, url = service
    rows = [_row(f"{kind}-{i}", sample, "x" * (i + sample))
            for i, kind in enumerate(["ok", "flaky", "slow", "ok", "flaky", "ok"]) for sample in range(2)]
    client = _client(url)
    try:
        scores = client.score(rows)
    finally:
        client.close()
    assert scores == [len(row["response"]) + 10 * row["sample"] for row in rows]
    assert {key: n for key, n in state.attempts.items()} == {
        (row["uid"], row["sample"]): 1 if row["uid"].startswith("ok") else 2 for row in rows}
    assert 1 < state.most_in_flight <= MAX_CONCURRENCY


def test_rows_that_keep_failing_are_named_never_scored_zero(service):
    state, url = service
    rows = [_row("ok-0", 0, "abc"), _row("broken-1", 1, "abc"), _row("refused-2", 0, "abc"),
            _row("garbled-3", 0, "abc"), _row("ok-4", 1, "a")]
    client = _client(url)
    try:
        with pytest.raises(RemoteRewardError) as error:
            client.score(rows)
    finally:
        client.close()
    failures = {(uid, sample): message for uid, sample, message in error.value.failures}
    assert set(failures) == {("broken-1", 1), ("refused-2", 0), ("garbled-3", 0)}
    assert "HTTP 500" in failures[("broken-1", 1)] and f"after {RETRIES + 1} attempts" in failures[("broken-1", 1)]
    assert "HTTP 400" in failures[("refused-2", 0)]
    assert "no numeric 'score'" in failures[("garbled-3", 0)]
    assert "uid broken-1 sample 1" in str(error.value)
    # Retries only where they can help; the rows that worked were asked once.
    assert state.attempts == Counter({("ok-0", 0): 1, ("broken-1", 1): RETRIES + 1, ("refused-2", 0): 1,
                                      ("garbled-3", 0): 1, ("ok-4", 1): 1})


def test_an_unreachable_service_is_retried_then_named():
    client = RemoteRewardClient("http://127.0.0.1:9/score", max_concurrency=2, timeout_s=1.0, retries=1,
                                backoff_s=0.01)
    try:
        with pytest.raises(RemoteRewardError, match=r"uid u sample 0: .*ClientConnectorError.* after 2 attempts"):
            client.score([_row("u", 0, "x")])
    finally:
        client.close()
