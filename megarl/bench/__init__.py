"""Benchmarking support: the one report format every megarl benchmark writes (`megarl.bench.report`).

Importing this package loads the standard library only, so a micro-benchmark,
the controller and the CLI can all use it without paying for torch or ray.
"""

from megarl.bench.report import Column, Report, Table, collect_machine, collect_versions

__all__ = ["Column", "Report", "Table", "collect_machine", "collect_versions"]
