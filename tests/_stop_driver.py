"""A stand-in for `megarl train` whose run is a loop, for the exit-status tests of `test_preemption.py`.

`python _stop_driver.py SCENARIO RECIPE` runs `megarl.cli.main(["train", RECIPE])` with `controller.run.train`
replaced: inside a `Preemption` block like the real run's, the "run" loops until a stop is requested, then
tears down. It prints `ready` once its handlers are in place and `tearing down` when the second signal is
due. SCENARIO says where that second signal lands:
- phase:    the first signal is not acted on yet (a long phase), and a worker dies under the teardown;
- teardown: the run is stopping servers and workers inside the block (a cleanup that takes time);
- after:    the block is done (`Preempted` on its way out), the last cleanups (Ray's shutdown) still run.
"""

from __future__ import annotations

import sys
import time
import types
from contextlib import ExitStack


def _slow(seconds: float) -> None:
    print("tearing down", flush=True)
    time.sleep(seconds)


def _worker_died() -> None:
    raise RuntimeError("the actor died unexpectedly before finishing this task")


def fake_train(recipe, *, ray_address=None):
    from megarl.controller.preemption import Preempted, Preemption

    scenario = sys.argv[1]
    with ExitStack() as cleanup:
        if scenario == "after":
            cleanup.callback(_slow, 30)  # registered before the block: runs after it
        preemption = cleanup.enter_context(Preemption(300.0))
        if scenario == "phase":
            cleanup.callback(_worker_died)
        if scenario == "teardown":
            cleanup.callback(_slow, 30)
        print("ready", flush=True)
        while not preemption.requested or scenario == "phase":
            if scenario == "phase" and preemption.requested:
                print("tearing down", flush=True)  # (the phase goes on; the second signal ends it)
                time.sleep(30)
            time.sleep(0.01)
        raise Preempted(None, None)


if __name__ == "__main__":
    sys.modules["megarl.controller.run"] = types.SimpleNamespace(train=fake_train)
    from megarl.cli import main

    raise SystemExit(main(["train", sys.argv[2]]))
