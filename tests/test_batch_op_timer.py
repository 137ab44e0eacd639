"""The controller's Batch-operation timer (`megarl.protocol.op_timer`): what counts, and only once.

Checked against a reference count of the outermost calls made, and against the wall
time of the measured block (the operations cannot take longer than the block).
"""

from __future__ import annotations

import threading
import time

import torch

from megarl.protocol import Batch
from megarl.protocol.op_timer import measure_batch_ops


def _batch(rows: int = 64) -> Batch:
    return Batch.from_dict({"input_ids": torch.zeros(rows, 16, dtype=torch.long), "uid": [str(i) for i in range(rows)]})


def test_outermost_calls_count_once_and_only_while_measuring():
    batch = _batch()
    batch.repeat(2)  # before the measurement: not counted
    start = time.perf_counter()
    with measure_batch_ops() as ops:
        repeated = batch.repeat(4)  # 1
        repeated[::2]  # 2: __getitem__ (it calls _take internally, which is not a second call)
        Batch.concat(repeated.chunk(4))  # 3, 4
        repeated["input_ids"]  # 5
    block = time.perf_counter() - start
    assert ops.calls == 5
    assert 0 < ops.seconds <= block
    repeated.select(["uid"])  # after it: not counted
    assert ops.calls == 5


def test_measurements_are_per_thread():
    batch = _batch()
    seen = {}

    def other_thread():
        batch.repeat(3)  # no measurement open on this thread
        with measure_batch_ops() as ops:
            batch.select(["uid"])
        seen["other"] = ops.calls

    with measure_batch_ops() as ops:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        batch.clone()
    assert ops.calls == 1 and seen["other"] == 1
