"""Benchmark reports: what was measured, where, with which versions and settings; as JSON and Markdown.

A `Report` holds the benchmark's name, the date (UTC, taken when the report
is made, i.e. at the end of the run), the machine (CPU, cores, memory, GPUs,
load average), the versions of python, torch, megatron-core, sglang, ray and
megarl, the settings the run used, one or more named `Table`s of figures with
units, and free-form notes. `write(DIR)` puts `<name>.json` and `<name>.md` in
DIR; `Report.read(path)` loads the JSON back, checking its shape.

The first column of a table names its rows (an operation, a phase, a
transport): two reports of the same benchmark line up by table name and that
row key, which is what a side-by-side comparison divides cell by cell. Numbers
are stored at full precision; each column's format applies to Markdown only.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import megarl
from megarl.errors import InputError

FORMAT = "megarl-bench-report/1"
PACKAGES = ("torch", "megatron-core", "sglang", "ray")
NOT_INSTALLED = "not installed"

Cell = float | int | str | bool | None


@dataclass
class Column:
    """One column: its name, the unit of its figures ("" for labels) and a Markdown format spec (e.g. ".3f")."""

    name: str
    unit: str = ""
    format: str = ""

    @property
    def title(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name

    def render(self, cell: Cell) -> str:
        if cell is None:
            return ""
        if isinstance(cell, float) and not self.format:
            return f"{cell:.4g}"
        return format(cell, self.format) if self.format and not isinstance(cell, (str, bool)) else str(cell)


@dataclass
class Table:
    """A named table of rows; the first column is the row key."""

    name: str
    columns: list[Column]
    rows: list[list[Cell]] = field(default_factory=list)

    def add_row(self, *cells: Cell) -> None:
        """Append one row. A wrong cell count, a repeated row key, a cell that is not a number, string or None,
        or a non-finite number is a programming error (ValueError)."""
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.name!r}: {len(cells)} cells for {len(self.columns)} columns")
        if any(row[0] == cells[0] for row in self.rows):
            raise ValueError(f"table {self.name!r}: a second row keyed {cells[0]!r} (the first cell names the row)")
        for column, cell in zip(self.columns, cells):
            if cell is not None and not isinstance(cell, (float, int, str, bool)):
                raise ValueError(f"table {self.name!r}, column {column.name!r}: {cell!r} is not a number or string")
            if isinstance(cell, float) and not math.isfinite(cell):
                raise ValueError(f"table {self.name!r}, column {column.name!r}: {cell} is not finite")
        self.rows.append(list(cells))

    def column(self, name: str) -> list[Cell]:
        """The cells of column `name`, top to bottom."""
        index = [c.name for c in self.columns].index(name)
        return [row[index] for row in self.rows]

    def to_markdown(self) -> str:
        """A Markdown table padded to aligned columns (readable as printed text too); figures right-aligned."""
        cells = [[c.title for c in self.columns]] + [[c.render(x) for c, x in zip(self.columns, r)] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        numeric = [any(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in self.rows)
                   for i in range(len(self.columns))]

        def line(row: list[str]) -> str:
            padded = [cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(row, widths, numeric)]
            return "| " + " | ".join(padded) + " |"

        rule = "|" + "|".join(("-" * (w + 1) + ":") if num else "-" * (w + 2) for w, num in zip(widths, numeric)) + "|"
        return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


@dataclass
class Report:
    """One benchmark run. Build with `Report.create`, fill with `add_table`/`notes`, then `write`."""

    name: str
    date: str
    machine: dict
    versions: dict
    settings: dict
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, name: str, settings: dict, extra_packages: tuple[str, ...] = ()) -> Report:
        """A report dated now, with this machine and the installed versions (plus `extra_packages`).

        `settings` must be JSON data; it is stored as JSON reads it back
        (tuples become lists), so a written and re-read report compares equal.
        """
        return cls(
            name=name,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            machine=collect_machine(),
            versions=collect_versions(extra_packages),
            settings=json.loads(json.dumps(settings)),
        )

    def add_table(self, name: str, columns: list[Column]) -> Table:
        """A new empty table, appended to the report; names are unique within a report."""
        if any(t.name == name for t in self.tables):
            raise ValueError(f"report {self.name!r} already has a table {name!r}")
        table = Table(name, list(columns))
        self.tables.append(table)
        return table

    def table(self, name: str) -> Table:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"report {self.name!r} has no table {name!r} (has: {', '.join(t.name for t in self.tables)})")

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "date": self.date,
            "machine": self.machine,
            "versions": self.versions,
            "settings": self.settings,
            "tables": [
                {"name": t.name, "columns": [vars(c) for c in t.columns], "rows": t.rows} for t in self.tables
            ],
            "notes": self.notes,
        }

    def to_markdown(self, *, with_settings: bool = True) -> str:
        """The whole report; `with_settings=False` leaves out the settings table (a long resolved recipe)."""
        machine, lines = self.machine, [f"# {self.name}", ""]
        gpus = ", ".join(machine.get("gpus") or []) or "none"
        load = "/".join(f"{x:.2f}" for x in machine.get("load_average", []))
        lines += [
            f"- date: {self.date}",
            f"- machine: {machine.get('cpu')}, {machine.get('cores')} cores ({machine.get('usable_cores')} usable), "
            f"{machine.get('memory_gib')} GiB memory, GPUs: {gpus}; load average (1/5/15 min) {load} at the end",
            "- versions: " + ", ".join(f"{name} {version}" for name, version in self.versions.items()),
        ]
        if with_settings:
            settings = Table("settings", [Column("setting"), Column("value")])
            for key, value in flatten_settings(self.settings):
                settings.add_row(key, json.dumps(value) if isinstance(value, (list, dict)) else value)
            lines += ["", "## settings", "", settings.to_markdown()]
        for table in self.tables:
            lines += ["", f"## {table.name}", "", table.to_markdown()]
        if self.notes:
            lines += ["", "## notes", ""] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write `<out_dir>/<name>.json` and `<name>.md` (the directory is created); returns both paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out / f"{self.name}.json", out / f"{self.name}.md"
        json_path.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
        md_path.write_text(self.to_markdown())
        return json_path, md_path

    @classmethod
    def from_dict(cls, data: dict, source: str = "report") -> Report:
        """The inverse of `to_dict`; InputError naming `source` and the bad key when the shape is wrong."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise InputError(f"{source}: not a megarl benchmark report (format {found!r}, expected {FORMAT!r})")
        expected = {"name": str, "date": str, "machine": dict, "versions": dict, "settings": dict,
                    "tables": list, "notes": list}
        for key, kind in expected.items():
            if not isinstance(data.get(key), kind):
                raise InputError(f"{source}: {key}: expected a {kind.__name__}, got {data.get(key)!r:.80}")
        tables = []
        for i, raw in enumerate(data["tables"]):
            try:
                table = Table(raw["name"], [Column(**c) for c in raw["columns"]])
                for row in raw["rows"]:
                    table.add_row(*row)
            except (KeyError, TypeError, ValueError) as error:
                raise InputError(f"{source}: tables[{i}]: {error}") from None
            tables.append(table)
        fields = {key: data[key] for key in expected if key != "tables"}
        return cls(**fields, tables=tables)

    @classmethod
    def read(cls, path: str | Path) -> Report:
        """Load a report written by `write`; InputError naming the file when it is not one."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise InputError(f"{path}: cannot read a benchmark report: {error}") from None
        return cls.from_dict(data, source=str(path))


def flatten_settings(settings: dict, prefix: str = "") -> list[tuple[str, Cell | list]]:
    """Nested settings -> (dotted key, leaf) pairs, in insertion order."""
    pairs = []
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            pairs += flatten_settings(value, f"{prefix}{key}.")
        else:
            pairs.append((f"{prefix}{key}", value))
    return pairs


def collect_machine() -> dict:
    """CPU model, cores (all and usable by this process), memory, GPUs and load average: standard library only."""
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(pages * page_size / 2**30, 1),
        "gpus": _gpus(),
        "os": platform.platform(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    """'name, memory' per NVIDIA GPU from nvidia-smi (no torch import); [] when there is none."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def collect_versions(extra_packages: tuple[str, ...] = ()) -> dict[str, str]:
    """python, torch, megatron-core, sglang, ray, megarl (+ extras): installed versions, read without importing."""
    versions = {"python": platform.python_version()}
    for package in PACKAGES + tuple(extra_packages):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = NOT_INSTALLED
    versions["megarl"] = megarl.__version__ + _git_state(Path(megarl.__file__).parent)
    return versions


def _git_state(source: Path) -> str:
    """' (git <commit>)', with ', modified' for uncommitted changes, when megarl runs from a git checkout."""
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f" (git {commit}{', modified' if changes else ''})"
