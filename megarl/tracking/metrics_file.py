"""`metrics.jsonl`: one JSON object per logged step, read while the run may still be writing it.

`read_metrics` skips a last line that is not complete yet (or was cut by a crash);
`truncate_metrics` keeps the records up to a step, so a resumed run logs the steps
after its checkpoint again instead of twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """The complete records of `path`, in file order; a torn or unterminated line is ignored."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                break  # being written right now, or cut by a crash
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def truncate_metrics(path: Path, last_step: int) -> list[dict]:
    """Keep only the records of steps <= `last_step` (atomically); returns them."""
    if not path.exists():
        return []
    kept = [record for record in read_metrics(path) if record.get("step", 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(record, allow_nan=True) + "\n" for record in kept), encoding="utf-8")
    os.replace(tmp, path)
    return kept
