"""The update session never leaks: a begin that fails on one server ends the sessions the others opened, a
session a crashed sync left open is ended before the next begins, and the next sync succeeds.

Two real CPU engines (which refuse a second begin as SGLang does); the failure is injected between the
client and one server, as a dropped connection would be.
"""

from __future__ import annotations

import pytest
import torch
from _http import call
from _tiny import tiny_model

from megarl.rollout.client import RolloutClient, RolloutError
from megarl.rollout.weight_wire import serialize_named_tensors
from megarl.weightsync.session import NO_SESSION_OPEN, UpdateSession, WeightSyncError

pytestmark = pytest.mark.dist

API_KEY = "session-key"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, cpu_engine):
    root = tmp_path_factory.mktemp("session")
    tiny_model("llama", seed=0).save_pretrained(root / "model")
    return [cpu_engine(root / "model", api_key=API_KEY) for _ in range(2)]


class FailingBegin(RolloutClient):
    """A client whose first `/begin_weight_update` to `victim` is lost on the way (no response)."""

    def __init__(self, urls, victim: str):
        super().__init__(urls, api_key=API_KEY, timeout_s=60)
        self.victim, self.failures_left = victim, 1

    async def request(self, url, method, endpoint, body=None):
        if url == self.victim and endpoint == "/begin_weight_update" and self.failures_left:
            self.failures_left -= 1
            raise RolloutError(url, endpoint, None, "ClientConnectorError: connection reset")
        return await super().request(url, method, endpoint, body)


def session_open(handle) -> bool:
    return call(handle.url, "/server_info", key=API_KEY)[1]["weight_update_session_open"]


def norm_update(value: float) -> list[tuple[str, torch.Tensor]]:
    return [("model.norm.weight", torch.full((64,), value))]


def test_a_begin_failing_on_one_server_leaves_no_session_and_the_next_sync_succeeds(servers):
    first, second = servers
    with FailingBegin([first.url, second.url], victim=second.url) as client:
        session = UpdateSession(client)
        with pytest.raises(WeightSyncError, match=r"begin weight update: .*connection reset"):
            session.open()
        # The server whose begin succeeded had its session ended again; generation was resumed.
        assert not session_open(first) and not session_open(second)
        assert not any(call(h.url, "/server_info", key=API_KEY)[1]["paused"] for h in servers)

        session.open()  # the next sync: every begin succeeds
        client.update_weights_from_tensor(norm_update(0.5), flush_cache=False)
        session.close(weight_version="after-failure")
    assert [call(h.url, "/model_info", key=API_KEY)[1]["weight_version"] for h in servers] == ["after-failure"] * 2
    assert not session_open(first) and not session_open(second)


def test_a_session_left_open_by_a_crashed_sync_is_ended_before_the_next_begins(servers):
    first, second = servers
    # A trainer that died between begin and end leaves the second server's session open: its own
    # begin is refused as SGLang refuses it...
    assert call(second.url, "/begin_weight_update", {}, key=API_KEY)[0] == 200
    status, reply = call(second.url, "/begin_weight_update", {}, key=API_KEY)
    assert (status, reply["message"]) == (400, "a weight-update session is already open; call end_weight_update() "
                                                "first")
    # ...and the next sync ends it first, then opens its own everywhere.
    with RolloutClient([first.url, second.url], api_key=API_KEY, timeout_s=60) as client:
        session = UpdateSession(client)
        session.open()
        assert session_open(first) and session_open(second)
        client.update_weights_from_tensor(norm_update(0.25), flush_cache=False)
        session.close(weight_version="after-stale")
    assert not session_open(first) and not session_open(second)


def test_session_refusals_are_sglangs_words_and_the_client_knows_the_no_session_one(servers):
    """SGLang 0.5.23's texts (`weight_updater.py`: end and updates without a session), each a 400."""
    first, _ = servers
    status, reply = call(first.url, "/end_weight_update", {}, key=API_KEY)
    assert (status, reply["message"]) == (400, NO_SESSION_OPEN)
    assert NO_SESSION_OPEN == "no weight-update session is open; call begin_weight_update() first"
    entry = serialize_named_tensors(norm_update(1.0))
    status, reply = call(first.url, "/update_weights_from_tensor", {"serialized_named_tensors": [entry]}, key=API_KEY)
    assert (status, reply["message"]) == (400, "update_weights_from_tensor must run between begin_weight_update() "
                                               "and end_weight_update()")
    with RefusingEnd([first.url], "no weight-update session is open; call begin_weight_update() first") as client:
        UpdateSession(client, pause_mode=None).open()  # the stale-session end's 400 is the expected one
        UpdateSession(client, pause_mode=None).abort()
    with RefusingEnd([first.url], "end_weight_update: bad request") as client:
        with pytest.raises(WeightSyncError, match="end stale weight update: .*bad request"):
            UpdateSession(client, pause_mode=None).open()
    assert not session_open(first)


class RefusingEnd(RolloutClient):
    """A client whose first `/end_weight_update` answers 400 with `message` in place of the server."""

    def __init__(self, urls, message: str):
        super().__init__(urls, api_key=API_KEY, timeout_s=60)
        self.message, self.refusals_left = message, 1

    async def request(self, url, method, endpoint, body=None):
        if endpoint == "/end_weight_update" and self.refusals_left:
            self.refusals_left -= 1
            raise RolloutError(url, endpoint, 400, self.message)
        return await super().request(url, method, endpoint, body)
