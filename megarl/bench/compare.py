"""`megarl bench --compare A.json B.json ...`: reports side by side, each figure as a ratio to the first report.

Reports line up as the report format promises: by table name, then by the row key
(the first column) and the column name. Every numeric cell of the first report gets
a line with its value in each report and, for the others, the ratio to the first
(a ratio above 1 means a larger figure: slower for seconds, faster for tokens/s).
Rows only the later reports have are listed too, without a ratio. Tables keyed by
numbers (per-step listings) are left out: their rows are steps, which do not line
up from one run to another. The settings that differ between the reports come
first, so a comparison shows what was changed next to what it did. Standard
library only, like the report format.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from megarl.bench.report import Cell, Column, Report, Table, flatten_settings


def _label(index: int) -> str:
    return string.ascii_uppercase[index] if index < 26 else f"R{index + 1}"


def _numeric(cell: Cell) -> bool:
    return isinstance(cell, (int, float)) and not isinstance(cell, bool)


def _cells(table: Table | None) -> dict[str, tuple[Cell, Column]]:
    """'<row key>: <column title>' -> (cell, column) of every numeric cell of `table` past the key column."""
    if table is None:
        return {}
    return {f"{row[0]}: {column.title}": (cell, column)
            for row in table.rows for column, cell in zip(table.columns[1:], row[1:]) if _numeric(cell)}


def _table_of(report: Report, name: str) -> Table | None:
    return next((table for table in report.tables if table.name == name), None)


def _header(reports: list[tuple[str, Report]]) -> Table:
    table = Table("reports", [Column("report"), Column("file"), Column("benchmark"), Column("date"),
                              Column("machine"), Column("load at end"), Column("megarl")])
    for index, (source, report) in enumerate(reports):
        machine = report.machine
        load = "/".join(f"{x:.2f}" for x in machine.get("load_average", []))
        table.add_row(_label(index), source, report.name, report.date,
                      f"{machine.get('cpu')}, {machine.get('cores')} cores, GPUs: "
                      f"{', '.join(machine.get('gpus') or []) or 'none'}", load, report.versions.get("megarl", ""))
    return table


def _settings_differences(reports: list[tuple[str, Report]]) -> Table:
    flat = [dict(flatten_settings(report.settings)) for _, report in reports]
    table = Table("settings that differ", [Column("setting")] + [Column(_label(i)) for i in range(len(reports))])
    for key in dict.fromkeys(key for settings in flat for key in settings):
        values = [json.dumps(settings[key]) if key in settings else "(absent)" for settings in flat]
        if len(set(values)) > 1:
            table.add_row(key, *values)
    return table


def _figures(name: str, reports: list[tuple[str, Report]]) -> Table:
    columns = [Column("figure"), Column(_label(0))]
    for index in range(1, len(reports)):
        columns += [Column(_label(index)), Column(f"{_label(index)}/{_label(0)}", "x", ".3f")]
    table = Table(name, columns)
    cells = [_cells(_table_of(report, name)) for _, report in reports]
    for key in dict.fromkeys(key for per_report in cells for key in per_report):
        first = cells[0].get(key)
        line: list[Cell] = [key, _shown(first)]
        for other in cells[1:]:
            cell = other.get(key)
            line += [_shown(cell), cell[0] / first[0] if cell is not None and first is not None and first[0] else None]
        table.add_row(*line)
    return table


def _shown(cell: tuple[Cell, Column] | None) -> str:
    """A figure as its report's Markdown shows it ('' when that report lacks it)."""
    return "" if cell is None else cell[1].render(cell[0])


def compare_reports(paths: list[Path]) -> tuple[str, list[Table]]:
    """Markdown comparing the reports at `paths` (the first is the reference) and its tables."""
    reports = [(str(path), Report.read(path)) for path in paths]
    names = [table.name for _, report in reports for table in report.tables
             if table.rows and not any(_numeric(row[0]) for row in table.rows)]
    tables = [_header(reports), _settings_differences(reports)]
    tables += [_figures(name, reports) for name in dict.fromkeys(names)]
    lines = [f"# comparison of {len(reports)} benchmark reports (ratios to {_label(0)})"]
    for table in tables:
        lines += ["", f"## {table.name}", "", table.to_markdown() if table.rows else "(none)"]
    return "\n".join(lines) + "\n", tables


def write_comparison(paths: list[Path], out_dir: Path) -> tuple[str, Path]:
    """The comparison's Markdown, also written to `<out_dir>/compare.md`."""
    markdown, _ = compare_reports(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "compare.md"
    target.write_text(markdown)
    return markdown, target
