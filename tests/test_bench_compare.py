"""`megarl bench --compare` on two recorded bench reports (tests/fixtures/bench/: the quickstart at train batch
sizes 8 and 16, `--synthetic`, 1 warm-up + 2 measured steps): the expected side-by-side table.

The expected figures are read straight from the JSON files, not through the comparison code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.bench.compare import compare_reports
from megarl.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bench"
A, B = FIXTURES / "quickstart-batch8.json", FIXTURES / "quickstart-batch16.json"


def _cell(path: Path, table: str, row: str, column: str) -> float:
    data = json.loads(path.read_text())
    raw = next(t for t in data["tables"] if t["name"] == table)
    index = next(i for i, c in enumerate(raw["columns"]) if c["name"] == column)
    return next(r[index] for r in raw["rows"] if r[0] == row)


def _rows(path: Path, table: str) -> list[str]:
    return [row[0] for row in next(t for t in json.loads(path.read_text())["tables"] if t["name"] == table)["rows"]]


def _line(markdown: str, figure: str) -> list[str]:
    """The cells of the comparison line of `figure` ('<row>: <column title>')."""
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {figure} "))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_two_recorded_reports_side_by_side(tmp_path, capsys):
    assert main(["bench", "--compare", str(A), str(B), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    markdown = (tmp_path / "compare.md").read_text()
    assert printed == markdown + f"wrote {tmp_path / 'compare.md'}\n"

    # Which report is which, and what differs between them: the batch size and what follows from it.
    assert "| A      | " in markdown and str(A) in markdown and str(B) in markdown
    assert _line(markdown, "recipe.data.train_batch_size")[1:] == ["8", "16"]
    assert _line(markdown, "recipe.data.synthetic.num_train")[1:] == ["24", "48"]
    assert "recipe.data.max_prompt_length" not in markdown  # equal in both: not listed

    for table, row, column, unit, fmt in [
        ("phases", "step", "median", "s", ".3f"),
        ("phases", "gen", "median", "s", ".3f"),
        ("throughput", "trained (prompt + response tokens)", "per step", "tokens", ".0f"),
        ("throughput", "generated (response tokens)", "over the step", "tokens/s/device", ".1f"),
        ("model FLOPs utilisation", "training phases", "MFU", "%", ".2f"),
        ("controller overhead", "Batch operations", "median share of step", "%", ".2f"),
    ]:
        a, b = _cell(A, table, row, column), _cell(B, table, row, column)
        cells = _line(markdown, f"{row}: {column} ({unit})")
        assert cells[1:] == [format(a, fmt), format(b, fmt), f"{b / a:.3f}"], (table, row, column)
    # Twice the prompts, the same lengths: exactly twice the tokens.
    assert _line(markdown, "trained (prompt + response tokens): per step (tokens)")[3] == "2.000"
    # Per-step listings do not line up across runs: not compared.
    assert "## steps" not in markdown and "## phases" in markdown and "## settings that differ" in markdown


def test_compare_tables_hold_the_numbers():
    _, tables = compare_reports([A, B])
    phases = next(table for table in tables if table.name == "phases")
    ratio = dict(zip(phases.column("figure"), phases.column("B/A")))["step: median (s)"]
    assert ratio == pytest.approx(_cell(B, "phases", "step", "median") / _cell(A, "phases", "step", "median"))


def test_bad_invocations_exit_2_naming_the_problem(tmp_path, capsys):
    assert main(["bench"]) == 2
    assert "give a recipe to run, or --compare" in capsys.readouterr().err
    assert main(["bench", str(A), "--compare", str(A), str(B)]) == 2
    assert "not both" in capsys.readouterr().err
    not_a_report = tmp_path / "x.json"
    not_a_report.write_text('{"format": "something else"}')
    assert main(["bench", "--compare", str(A), str(not_a_report), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(not_a_report) in err and "not a megarl benchmark report" in err and "Traceback" not in err
    assert not (tmp_path / "compare.md").exists()


def test_the_comparison_opens_with_a_summary_and_leaves_out_figures_zero_in_both(tmp_path):
    # A figure that shows as zero in both reports (a phase that took no time) is rounding noise: left out.
    copies = []
    for source in (A, B):
        data = json.loads(source.read_text())
        phases = next(t for t in data["tables"] if t["name"] == "phases")
        median = next(i for i, c in enumerate(phases["columns"]) if c["name"] == "median")
        next(r for r in phases["rows"] if r[0] == "adv")[median] = 0.0001 if source is A else 0.0
        copies.append(tmp_path / source.name)
        copies[-1].write_text(json.dumps(data))
    markdown, tables = compare_reports(copies)
    assert [table.name for table in tables[:3]] == ["reports", "summary", "settings that differ"]
    summary = markdown.split("## summary", 1)[1].split("\n## ", 1)[0]
    figures = [line.split("|")[1].strip() for line in summary.splitlines() if line.startswith("| ")][1:]
    assert figures[:4] == ["step: median (s)", "generated (response tokens): over the step (tokens/s/device)",
                           "trained (prompt + response tokens): over the step (tokens/s/device)",
                           "training phases: MFU (%)"]
    # Then the three phases whose median moved most, largest first, read from the reports themselves.
    moved = sorted(((abs(_cell(B, "phases", phase, "median") - _cell(A, "phases", phase, "median")), phase)
                    for phase in _rows(A, "phases") if phase != "step"),
                   reverse=True)
    assert figures[4:] == [f"{phase}: median (s)" for _, phase in moved[:3]]
    assert _line(markdown, "step: median (s)")[1:] == [format(_cell(A, "phases", "step", "median"), ".3f"),
                                                       format(_cell(B, "phases", "step", "median"), ".3f"),
                                                       f"{_cell(B, 'phases', 'step', 'median') / _cell(A, 'phases', 'step', 'median'):.3f}"]
    assert "| adv: median (s) " not in markdown and "| gen: median (s) " in markdown
