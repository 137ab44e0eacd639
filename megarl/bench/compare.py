"""`megarl bench --compare A.json B.json ...`: reports side by side, each figure as a ratio to the first report.

Reports line up as the report format promises: by table name, then by the row key
(the first column) and the column name. Every numeric cell of the first report gets
a line with its value in each report and, for the others, the ratio to the first
(a ratio above 1 means a larger figure: slower for seconds, faster for tokens/s); a
figure that shows as zero (or is absent) in every report is left out. Rows only the later reports
have are listed too, without a ratio. A summary opens the comparison: the step time,
tokens/s per device, MFU and the three phases whose median time changed most. Tables keyed by
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


# The summary's figures, by table: the step time, throughput per device and MFU.
SUMMARY = {
    "phases": ["step: median (s)"],
    "throughput": ["generated (response tokens): over the step (tokens/s/device)",
                   "trained (prompt + response tokens): over the step (tokens/s/device)"],
    "model FLOPs utilisation": ["training phases: MFU (%)"],
}
# ... then this many phases whose median changed most; a phase's median is the key ending so.
PHASE_CHANGES = 3
PHASE_MEDIAN = ": median (s)"


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


def _figure_columns(reports: list[tuple[str, Report]]) -> list[Column]:
    columns = [Column("figure"), Column(_label(0))]
    for index in range(1, len(reports)):
        columns += [Column(_label(index)), Column(f"{_label(index)}/{_label(0)}", "x", ".3f")]
    return columns


def _add_figure(table: Table, key: str, cells: list[dict[str, tuple[Cell, Column]]]) -> None:
    """The line of figure `key`: its value in each report, and each later report's ratio to the first."""
    first = cells[0].get(key)
    line: list[Cell] = [key, _shown(first)]
    for other in cells[1:]:
        cell = other.get(key)
        line += [_shown(cell), cell[0] / first[0] if cell is not None and first is not None and first[0] else None]
    table.add_row(*line)


def _figures(name: str, reports: list[tuple[str, Report]]) -> Table:
    table = Table(name, _figure_columns(reports))
    cells = [_cells(_table_of(report, name)) for _, report in reports]
    for key in dict.fromkeys(key for per_report in cells for key in per_report):
        if all(_shows_zero(per_report.get(key)) for per_report in cells):
            continue  # zero as shown (or absent) everywhere: a ratio of rounding noise
        _add_figure(table, key, cells)
    return table


def _summary(reports: list[tuple[str, Report]]) -> Table:
    """`SUMMARY`'s figures, then the `PHASE_CHANGES` phases whose median moved most (in seconds) in any report."""
    table = Table("summary", _figure_columns(reports))
    for name, keys in SUMMARY.items():
        cells = [_cells(_table_of(report, name)) for _, report in reports]
        for key in keys:
            if any(key in per_report for per_report in cells):
                _add_figure(table, key, cells)
    phases = [_cells(_table_of(report, "phases")) for _, report in reports]
    medians = [key for key in phases[0] if key.endswith(PHASE_MEDIAN) and key != SUMMARY["phases"][0]]
    change = {key: max((abs(other[key][0] - phases[0][key][0]) for other in phases[1:] if key in other), default=0.0)
              for key in medians}
    for key in sorted(change, key=change.get, reverse=True)[:PHASE_CHANGES]:
        if change[key] > 0:
            _add_figure(table, key, phases)
    return table


def _shows_zero(cell: tuple[Cell, Column] | None) -> bool:
    if cell is None:
        return True
    try:
        return float(_shown(cell)) == 0.0
    except ValueError:  # rendered with more than a number
        return False


def _shown(cell: tuple[Cell, Column] | None) -> str:
    """A figure as its report's Markdown shows it ('' when that report lacks it)."""
    return "" if cell is None else cell[1].render(cell[0])


def compare_reports(paths: list[Path]) -> tuple[str, list[Table]]:
    """Markdown comparing the reports at `paths` (the first is the reference) and its tables."""
    reports = [(str(path), Report.read(path)) for path in paths]
    names = [table.name for _, report in reports for table in report.tables
             if table.rows and not any(_numeric(row[0]) for row in table.rows)]
    tables = [_header(reports), _summary(reports), _settings_differences(reports)]
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
