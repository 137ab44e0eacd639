"""Quiet by default: the known third-party notices are hidden, megarl's own and unknown warnings are not, and
MEGARL_VERBOSE=1 (`megarl --verbose`) shows everything. Each case in a fresh process, as the CLI runs."""

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


def test_verbose_shows_it_all():
    result = _run(verbose=True)
    assert result.returncode == 0, result.stderr
    assert "Token authentication is enabled" in result.stderr and "ShardedTensor" in result.stderr
    assert "bars disabled: False" in result.stdout
