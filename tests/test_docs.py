"""The documentation in docs/: the recipe reference is the schema rendered now, every metric name the code can
log is defined on the metrics page, and every relative link of the docs and the README leads to a file."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from _metrics_doc import documented_names, undocumented

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PLACEHOLDER = "\0"  # an f-string's replacement field in a name the code builds


def test_the_recipe_reference_is_the_schema_rendered_now():
    # A fresh process: only megarl's built-in registries (tests register estimators and losses of their own).
    rendered = subprocess.run([sys.executable, "-m", "megarl", "schema", "--markdown"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    committed = (DOCS / "recipe.md").read_text()
    assert rendered == committed, "docs/recipe.md is stale: megarl schema --markdown > docs/recipe.md"
    for key in ("actor.policy_loss", "sft_warmup.steps", "trainer.checkpoint.resume", "rollout.n"):
        section, name = key.rsplit(".", 1)
        assert re.search(rf"^## `{re.escape(section)}`\n(?:.*\n)*?\| `{name}` \|", committed, flags=re.M), key


def _names_in_code() -> set[str]:
    """Every string in megarl/ shaped like a metric name under one of the page's prefixes: literals, and f-strings
    with PLACEHOLDER for each replacement field."""
    prefixes = "|".join(sorted({name.split("/")[0] for name in documented_names()}))
    shape = re.compile(rf"^({prefixes})/[\w/{PLACEHOLDER}]*[\w{PLACEHOLDER}]$")
    found = set()
    for path in (ROOT / "megarl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(part.value if isinstance(part, ast.Constant) else PLACEHOLDER for part in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if shape.match(text):
                found.add(text)
    return found


def test_every_metric_name_the_code_builds_is_on_the_metrics_page():
    names = _names_in_code()
    assert {"critic/vf_explained_var", "sft/loss", f"timing_s/{PLACEHOLDER}", "critic/score"} <= names
    documented = documented_names()
    missing = []
    for name in names:
        if PLACEHOLDER in name:  # some documented name must be one this template can build
            template = re.compile(".+".join(map(re.escape, name.split(PLACEHOLDER))) + "$")
            covered = any(template.match(doc) for doc in documented)
        else:  # a name, or the prefix of names built from it (critic/score -> critic/score/mean)
            covered = not undocumented([name]) or any(doc.startswith(name + "/") for doc in documented)
        if not covered:
            missing.append(name.replace(PLACEHOLDER, "{...}"))
    assert not missing, f"not on docs/metrics.md: {sorted(missing)}"


def test_a_recorded_runs_metrics_are_all_on_the_page():
    records = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "metrics_ppo.jsonl").open()]
    assert not undocumented({key for record in records for key in record})


def test_every_relative_link_of_the_docs_and_the_readme_leads_to_a_file():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken
    assert "(docs/README.md)" in (ROOT / "README.md").read_text()
