"""The README's architecture table, enforced: an ast walk of every import in megarl/.

Each package may import only itself and the packages above it in the table; the
top-level helper modules (`megarl/atomic.py`, `errors.py`, `net.py`, `oom.py`, `ports.py`, `processes.py`,
`quiet.py`, `registry.py`, `userfiles.py`) may be imported from anywhere and import no package. Seams the table
alone does not show are checked too: production weight sync never reaches into the CPU test
engine; Ray placement (placement groups, scheduling strategies) is megarl/cluster's
alone; the run (megarl/controller), the other commands and the metric sinks never
import Ray (they reach it through megarl/cluster); and no two modules import each
other, directly or around a loop.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megarl"
BASE_MODULES = ("megarl.atomic", "megarl.errors", "megarl.net", "megarl.oom", "megarl.ports", "megarl.processes",
                "megarl.quiet", "megarl.registry", "megarl.userfiles")
PLACEMENT_NAMES = ("placement_group", "PlacementGroupSchedulingStrategy", "remove_placement_group")


def _layers() -> list[str]:
    """The packages of the README's architecture table, top (imported by all) to bottom."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `megarl/([\w.]+)` \|", section, flags=re.M)
    return ["megarl." + row.removesuffix(".py") for row in rows]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement, at any depth (function-level imports count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _layer_of(module: str, layers: list[str]) -> int | None:
    for index, layer in enumerate(layers):
        if module == layer or module.startswith(layer + "."):
            return index
    return None


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_table_names_every_package():
    layers = _layers()
    assert layers[:2] == ["megarl.config", "megarl.protocol"] and layers[-1] == "megarl.cli"
    packages = {f"megarl.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and p.name != "assets"}
    assert packages <= set(layers), sorted(packages - set(layers))


def test_no_import_goes_down_the_table():
    layers = _layers()
    problems = []
    for path in SOURCES:
        module = _module_name(path)
        if module in BASE_MODULES:
            own = None  # may import no layer at all
        elif module in ("megarl", "megarl.__main__"):
            continue  # the package marker and `python -m megarl` (the CLI)
        else:
            own = _layer_of(module, layers)
            assert own is not None, f"{module} is in no layer of the README table"
        for line, imported in _imports(path):
            if not imported.startswith("megarl.") or imported in BASE_MODULES or _layer_of(imported, layers) is None:
                continue
            target = _layer_of(imported, layers)
            if own is None or target > own:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {imported}")
    assert not problems, "\n".join(problems)


def test_weight_sync_never_imports_the_cpu_engine():
    offending = [f"{path.relative_to(ROOT)}:{line}: {name}"
                 for path in SOURCES if _module_name(path).startswith("megarl.weightsync")
                 for line, name in _imports(path) if name.startswith("megarl.rollout.cpu_engine")]
    assert not offending, offending


def test_ray_placement_lives_in_the_cluster_only():
    offending = []
    for path in SOURCES:
        if _module_name(path).startswith("megarl.cluster"):
            continue
        for line, name in _imports(path):
            if name.rsplit(".", 1)[-1] in PLACEMENT_NAMES or name.startswith("ray.util.placement_group"):
                offending.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offending, offending


@pytest.mark.parametrize("package", ["megarl.controller", "megarl.commands", "megarl.tracking"])
def test_the_run_reaches_ray_through_the_cluster_package(package):
    offending = [f"{path.relative_to(ROOT)}:{line}: {name}"
                 for path in SOURCES if _module_name(path).startswith(package)
                 for line, name in _imports(path) if name == "ray" or name.startswith("ray.")]
    assert not offending, offending


def _module_graph() -> dict[str, set[str]]:
    """megarl module -> the megarl modules it imports, at any depth (`from pkg import mod` is an arrow to mod
    alone: it runs pkg/__init__ only if that has not begun, so it closes no loop through pkg)."""
    modules = {_module_name(path) for path in SOURCES}
    graph = {}
    for path in SOURCES:
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
                targets |= submodules if len(submodules) == len(node.names) else {node.module} | submodules
        graph[_module_name(path)] = {name for name in targets if name in modules and name != _module_name(path)}
    return graph


def test_no_import_cycles():
    graph = _module_graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("registry_name", ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "LOSS_AGG_MODES",
                                           "KL_PENALTIES", "REWARD_SCORERS", "WEIGHT_SYNC_TRANSPORTS",
                                           "MODEL_SPECS"])
def test_each_registry_loads_its_builtins_from_a_lower_layer(registry_name):
    import megarl.registry

    registry = getattr(megarl.registry, registry_name)
    assert _layer_of(registry.builtins, _layers()) is not None
    assert registry.names(), f"{registry_name}: {registry.builtins} registered nothing"


def test_the_sandbox_worker_stays_light():
    """A tool sandbox worker imports only what its calls need (no torch, numpy, pydantic, ray or aiohttp): it
    starts fast, and each call's address-space limit is spent on the tool, not on libraries."""
    import subprocess
    import sys

    code = ("import sys, megarl.agent.sandbox_worker, megarl.agent.tools; "
            "print(sorted(m for m in ('torch', 'numpy', 'pydantic', 'ray', 'aiohttp') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_plan_runs_where_only_a_recipe_and_config_json_are():
    """`megarl plan` reads a recipe and a config.json on a laptop: it imports no megatron, Ray, SGLang or
    transformers (and no engine, fleet or cluster module that would)."""
    import subprocess
    import sys

    code = ("import sys, megarl.plan.command, megarl.plan.plan, megarl.plan.report; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'ray', 'sglang', 'transformers')"
            " or m.startswith(('megarl.engines', 'megarl.rollout', 'megarl.cluster', 'megarl.controller'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


HEAVY = ("torch", "transformers", "aiohttp", "uvicorn", "fastapi", "pydantic")


def _heavy_modules_after(code: str) -> list[str]:
    import subprocess
    import sys

    code += ("\nprint(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in %r} | {m for m in sys.modules "
             "if m.startswith(('megarl.config', 'megarl.rollout.fleet', 'megarl.rollout.client'))}))" % (HEAVY,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return result.stdout.strip().splitlines()


def test_a_server_host_imports_no_torch():
    """A rollout server's host (one Ray actor per server) imports no torch, transformers, aiohttp, fleet or
    recipe schema: each would add seconds to every server's start."""
    assert _heavy_modules_after("import sys, megarl.rollout.server_host") == ["[]"]


def test_the_cpu_engine_checks_its_arguments_before_importing_torch(tmp_path):
    """`python -m megarl.rollout.cpu_engine` reads config.json and the safetensors headers and refuses a bad
    argument before torch, transformers or the server load: a refusal takes a fraction of a second."""
    (tmp_path / "config.json").write_text("{}")
    header = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    code = ("import runpy, sys\n"
            f"sys.argv = ['cpu_engine', '--model-path', {str(tmp_path)!r}, '--tokenizer-path', {str(tmp_path / 'no')!r}]\n"
            "try:\n    runpy.run_module('megarl.rollout.cpu_engine', run_name='__main__')\n"
            "except SystemExit as exited:\n    print(exited.code)")
    # The tokenizer directory is checked last, after config.json and every safetensors header were read.
    assert _heavy_modules_after(code) == ["2", "[]"]


def test_an_engine_rank_imports_neither_dynamo_nor_the_loggers():
    """What an engine rank imports builds no torch.compile wrapper (dynamo, inductor: ~3 CPU s a rank) and
    no W&B or TensorBoard (megatron's optional logging: ~1.5 CPU s and two temp dirs a rank), and both stay
    importable after."""
    import subprocess
    import sys

    code = ("import sys, megarl.cluster.engine_worker, megarl.engines.actor, megarl.engines.critic, "
            "megarl.engines.checkpoint, megarl.engines.export, megarl.engines.lora\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'wandb', 'tensorboard') if m in sys.modules))\n"
            "import wandb, torch.utils.tensorboard; print('importable')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines() == ["[]", "importable"]
