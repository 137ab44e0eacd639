"""The optional Weights & Biases sink (`trainer.logging.wandb`), offline unless the recipe says online.

The run id is created once and kept in `<run dir>/wandb_run_id`, so every resume of a
run appends to the same W&B run. W&B files go under `<run dir>/wandb/`. W&B keeps the
first value it received for a step: steps that a resume redoes keep their first values there
(metrics.jsonl and TensorBoard hold the redone ones).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Mapping

from megarl.errors import InputError

ID_FILE = "wandb_run_id"


class WandbSink:
    def __init__(self, run_dir: Path, *, name: str, project: str, entity: str | None, mode: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise InputError("trainer.logging.wandb.enabled: the wandb package is not installed; "
                             "pip install 'megarl[wandb]' (got true)") from None
        id_file = Path(run_dir) / ID_FILE
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(8) + "\n")
        self.run_id = id_file.read_text().strip()
        self._wandb = wandb
        self._run = wandb.init(project=project, entity=entity, id=self.run_id, name=name, resume="allow", mode=mode,
                               dir=str(run_dir), config=config,
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()  # stops W&B's service process, which writes out what it still holds
