"""Benchmarking: the one report format every megarl benchmark writes (`megarl.bench.report`), and `megarl bench`.

`megarl bench` is `run` (W + K steps through the controller), `step_report` (their
metrics as report tables), `flops` (model FLOPs per token), `bounds` (device peak and
transport bounds measured in the run), `progress` (the progress line) and `compare`
(reports side by side). Importing this package loads the standard library only, so a
micro-benchmark, the controller and the CLI can use the report without paying for
torch or ray; the modules behind `megarl bench` are imported by name.
"""

from megarl.bench.report import Column, Report, Table, collect_machine, collect_versions

__all__ = ["Column", "Report", "Table", "collect_machine", "collect_versions"]
