"""What launch/local.sh needs from a recipe, as shell exports: the run directory, device, slots and cluster.env.

It loads the recipe exactly as `megarl train` will (so bad input stops the
launcher with the same one-line errors and status 2), checks the placement
fits one machine, and gives the stop budget from the recipe's
`trainer.checkpoint.preempt_timeout_s`.

    eval "$(python -m megarl.submit.local RECIPE --set KEY=VALUE ...)"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.config import load_recipe
from megarl.errors import InputError
from megarl.submit.fit import check_fit
from megarl.submit.render import StopBudget, export_lines


def job_exports(recipe_path: Path, overrides: list[str]) -> str:
    recipe = load_recipe(recipe_path, overrides)
    per_node = recipe.placement.gpus_per_node
    check_fit(recipe, nodes=1, gpus_per_node=per_node)
    budget = StopBudget.for_timeout(recipe.trainer.checkpoint.preempt_timeout_s)
    run = {
        "MEGARL_RUN_DIR": str((Path.cwd() / recipe.trainer.output_dir / recipe.name).resolve()),
        "MEGARL_DEVICE": recipe.placement.device,
        "MEGARL_GPUS_PER_NODE": str(per_node),
        "MEGARL_TERM_GRACE_S": str(budget.kill_driver_s),
        "MEGARL_TEARDOWN_S": str(budget.teardown_s),
    }
    return "\n".join(export_lines({**run, **recipe.cluster.env})) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.submit.local", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(job_exports(args.recipe, args.overrides))
    except InputError as error:
        for problem in error.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
