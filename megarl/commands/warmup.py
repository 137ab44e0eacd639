"""A recipe's supervised warm-up on its own: `megarl warmup RECIPE --hf OUT`, and the warm-up checkpoint
that `megarl train-rm` starts its reward model from.

`megarl warmup` runs exactly the warm-up `megarl train` would (`megarl.controller.sft`: the recipe's
`sft_warmup`, on the actor's layout) and writes the warmed policy as an HF checkpoint. Runs
that start from it (`model.path: OUT`, `sft_warmup.steps: 0`) begin RL where the recipe's
own warm-up would have left them, so a sweep or a test session pays for the warm-up once.
Weights leave the engines as a weights-only checkpoint that each rank writes its own shards
of; `megarl export`'s conversion then makes the HF files. No full state dict passes through
the driver.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from pathlib import Path

from megarl.cluster.engine_worker import MegatronWorker, start_engine_group
from megarl.cluster.placement import plan_pools
from megarl.cluster.ray_cluster import ray_for_run
from megarl.config import Recipe
from megarl.config.settings import logprob_batching, warmup_engine_settings
from megarl.controller.bootstrap import RunData, prepare_data, prepare_initial_weights
from megarl.controller.preflight import prepare_run_dir
from megarl.controller.roles import PolicyRole
from megarl.controller.sft import run_sft_warmup
from megarl.errors import InputError
from megarl.tracking.tracker import Tracker


def warmed_up_checkpoint(recipe: Recipe, *, pool, layout_of: str, weights: Path, hf_config: dict, data: RunData,
                         tracker: Tracker, out_dir: Path) -> Path:
    """`weights` after `recipe.sft_warmup` on the layout of role `layout_of`, saved as a weights-only checkpoint
    in `out_dir` (replacing one left there); the engine group it ran on is gone afterwards."""
    group = start_engine_group(pool, name="sft_warmup", settings=warmup_engine_settings(recipe, layout_of=layout_of),
                               hf_config=hf_config, weights=str(weights), log_dir=None)
    try:
        run_sft_warmup(PolicyRole(group, batching=logprob_batching(recipe)), data, recipe, tracker)
        shutil.rmtree(out_dir, ignore_errors=True)
        group.run(MegatronWorker.save_checkpoint, str(out_dir), weights_only=True)
        return out_dir
    finally:
        group.kill()


def warm_up(recipe: Recipe, hf_out: Path, *, ray_address: str | None = None) -> Path:
    """Run `megarl warmup`: the recipe's warm-up, written as an HF checkpoint at `hf_out`; returns `hf_out`."""
    from megarl.engines.export import export_checkpoint

    hf_out = Path(hf_out).expanduser()
    if hf_out.exists() and (not hf_out.is_dir() or any(hf_out.iterdir())):
        raise InputError(f"--hf: {hf_out} exists and is not empty; choose a new directory")
    if recipe.sft_warmup.steps == 0:
        raise InputError("sft_warmup.steps: the recipe has no warm-up to run (got 0)")
    run_dir = prepare_run_dir(recipe)
    data = prepare_data(recipe, run_dir)
    weights = prepare_initial_weights(recipe, run_dir, data.tokenizer)
    checkpoint = run_dir / "warmup_checkpoint"
    with ExitStack() as cleanup:
        ray_for_run(cleanup, ray_address)
        logging = recipe.trainer.logging
        tracker = Tracker(run_dir / "warmup", total_steps=recipe.sft_warmup.steps, jsonl=False, tensorboard=False,
                          console=logging.console)
        cleanup.callback(tracker.close)
        pool = plan_pools(recipe)["actor"]
        cleanup.callback(pool.release)
        warmed_up_checkpoint(recipe, pool=pool, layout_of="actor", weights=weights,
                             hf_config=recipe.model.hf_config(), data=data, tracker=tracker, out_dir=checkpoint)
    # Ray's workers are gone and this process never joined torch.distributed: the conversion can run here.
    export_checkpoint(checkpoint, hf_out)
    shutil.rmtree(checkpoint)
    return hf_out
