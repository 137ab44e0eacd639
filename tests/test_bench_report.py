"""The benchmark report format: JSON round trip, Markdown rendering, machine/version collection, bad files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megarl.bench import Column, Report, collect_machine, collect_versions
from megarl.bench.report import FORMAT, NOT_INSTALLED
from megarl.errors import InputError


def sample_report() -> Report:
    report = Report.create("demo", {"samples": 8, "sizes": (1, 2), "model": {"hidden": 64, "tied": True}})
    table = report.add_table("timings", [Column("operation"), Column("time", "s", ".3f"), Column("ratio", "x")])
    table.add_row("gae", 0.123456, 1.5)
    table.add_row("grpo", 2.0, None)
    report.add_table("counts", [Column("what"), Column("n")]).add_row("rows", 3)
    report.notes.append("a note")
    return report


def test_round_trip_through_json_files(tmp_path):
    report = sample_report()
    json_path, md_path = report.write(tmp_path / "new-dir")
    assert json_path == tmp_path / "new-dir" / "demo.json" and md_path == tmp_path / "new-dir" / "demo.md"
    again = Report.read(json_path)
    assert again == report
    assert again.settings["sizes"] == [1, 2]  # stored as JSON reads it back, so the round trip is exact
    assert again.table("timings").column("time") == [0.123456, 2.0]  # full precision, not the Markdown format
    data = json.loads(json_path.read_text())
    assert data["format"] == FORMAT
    assert set(data) == {"format", "name", "date", "machine", "versions", "settings", "tables", "notes"}
    assert data["tables"][0]["columns"][1] == {"name": "time", "unit": "s", "format": ".3f"}


def test_markdown_has_header_settings_tables_and_notes():
    text = sample_report().to_markdown()
    assert text.startswith("# demo\n")
    for expected in ("- date: ", "- machine: ", "torch ", "megatron-core ", "sglang ", "ray ", "megarl 0.1.0",
                     "| model.hidden |", "## timings", "| time (s) |", "## notes", "- a note"):
        assert expected in text
    lines = text.splitlines()
    header = lines.index("## timings") + 2
    # Aligned columns; figures right-aligned with the column's format; an empty cell for None.
    assert lines[header] == "| operation | time (s) | ratio (x) |"
    assert lines[header + 1] == "|-----------|---------:|----------:|"
    assert lines[header + 2] == "| gae       |    0.123 |       1.5 |"
    assert lines[header + 3] == "| grpo      |    2.000 |           |"


def test_machine_and_versions():
    machine = collect_machine()
    assert machine["cores"] == os.cpu_count() and 1 <= machine["usable_cores"] <= machine["cores"]
    assert machine["memory_gib"] > 0 and machine["cpu"] and isinstance(machine["gpus"], list)
    assert len(machine["load_average"]) == 3
    versions = collect_versions(("surely-not-a-real-package-xyz",))
    assert list(versions)[:5] == ["python", "torch", "megatron-core", "sglang", "ray"]
    assert versions["surely-not-a-real-package-xyz"] == NOT_INSTALLED
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["megarl"].startswith("0.1.0")


def test_import_is_standard_library_only():
    code = "import sys, megarl.bench; print(sorted(m for m in ('torch', 'numpy', 'ray', 'megatron') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_rows_are_checked():
    table = sample_report().table("timings")
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        table.add_row("x", 1.0)
    with pytest.raises(ValueError, match="a second row keyed 'gae'"):
        table.add_row("gae", 1.0, 1.0)
    with pytest.raises(ValueError, match="column 'time': nan is not finite"):
        table.add_row("y", float("nan"), 1.0)
    with pytest.raises(ValueError, match=r"column 'ratio': \[1\] is not a number or string"):
        table.add_row("z", 1.0, [1])
    with pytest.raises(ValueError, match="already has a table 'timings'"):
        sample_report().add_table("timings", [Column("a")])
    with pytest.raises(KeyError, match="no table 'missing'"):
        sample_report().table("missing")


def test_reading_a_bad_file_names_it_and_the_problem(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match=f"{path}: cannot read a benchmark report"):
        Report.read(path)
    with pytest.raises(InputError, match="cannot read"):
        Report.read(tmp_path / "missing.json")
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(InputError, match="not a megarl benchmark report \\(format 'something-else'"):
        Report.read(path)
    good = sample_report().to_dict()
    path.write_text(json.dumps({**good, "machine": "laptop"}))
    with pytest.raises(InputError, match=f"{path}: machine: expected a dict, got 'laptop'"):
        Report.read(path)
    broken = json.loads(json.dumps(good))
    broken["tables"][0]["rows"][1] = ["grpo", 1.0]
    path.write_text(json.dumps(broken))
    with pytest.raises(InputError, match=r"tables\[0\]: table 'timings': 2 cells for 3 columns"):
        Report.read(path)
