"""Quiet by default: the known third-party notices are hidden, megarl's own and unknown warnings are not, and
MEGARL_VERBOSE=1 (`megarl --verbose`) shows everything. Each case in a fresh process, as the CLI runs.

Ray's processes' logs reach the driver through Ray's own printing handler; the forwarded batch here is one Ray's
raylet sends ~25 s into a run without `ray[default]` (its metrics agent missing), beside a line that must stay."""

from __future__ import annotations

import os
import subprocess
import sys

_NOISE = """
import warnings
from megarl.quiet import quiet_third_parties
quiet_third_parties()
from ray._private.authentication.authentication_token_setup import _warn_token_auth_enabled
_warn_token_auth_enabled()
warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
warnings.warn("some other library's deprecation", FutureWarning)
warnings.warn("megarl: a warning of its own")
import huggingface_hub.utils as hub
print("bars disabled:", hub.are_progress_bars_disabled())
# Ray's printing of its processes' logs, registered as `ray.init` registers it, then megarl's filter.
import functools
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
from ray._private.worker import print_to_stdstream
from megarl.quiet import hide_ray_backend_notices
dispatcher.add_handler("ray_print_logs", functools.partial(print_to_stdstream, ignore_prefix=False))
hide_ray_backend_notices()
hide_ray_backend_notices()  # twice: wrapped once
for pid, lines in (("raylet", ["[2026-12-02 09:21:31,965 E 1432 1432] (raylet) main.cc:1108: Failed to establish "
                               "connection to the metrics exporter agent. Metrics will not be exported.",
                               "(raylet) a raylet error of another kind"]),
                   ("gcs_server", ["(gcs_server) gcs_server.cc:1361: Failed to establish connection to the "
                                   "event+metrics exporter agent. Events and metrics will not be exported."])):
    dispatcher.emit({"ip": "127.0.0.1", "pid": pid, "job": "", "is_err": True, "lines": lines,
                     "actor_name": "", "task_name": ""})
print("handlers:", len(dispatcher.handlers))
"""


def _run(verbose: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("MEGARL_VERBOSE",
                                                                           "HF_HUB_DISABLE_PROGRESS_BARS")}
    if verbose:
        env["MEGARL_VERBOSE"] = "1"
    return subprocess.run([sys.executable, "-c", _NOISE], capture_output=True, text=True, timeout=120, env=env)


def test_known_noise_is_hidden_and_everything_else_shows():
    result = _run(verbose=False)
    assert result.returncode == 0, result.stderr
    assert "Token authentication" not in result.stderr and "ShardedTensor" not in result.stderr
    assert "some other library's deprecation" in result.stderr and "megarl: a warning of its own" in result.stderr
    assert "bars disabled: True" in result.stdout
    assert "metrics exporter agent" not in result.stderr and "a raylet error of another kind" in result.stderr
    assert "handlers: 1" in result.stdout


def test_verbose_shows_it_all():
    result = _run(verbose=True)
    assert result.returncode == 0, result.stderr
    assert "Token authentication is enabled" in result.stderr and "ShardedTensor" in result.stderr
    assert "bars disabled: False" in result.stdout
    assert result.stderr.count("metrics exporter agent") == 2
