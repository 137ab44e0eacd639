"""The report of `benchmarks/gpu_check.sh`: pytest's JUnit XML -> a JSON file and a summary of what ran.

    python3 benchmarks/gpu_report.py JUNIT_XML OUT_JSON PYTEST_EXIT_CODE SECONDS

The summary names every test that ran (passed, failed, error, with the failure's
message) and every test that was skipped with pytest's reason for it (no CUDA, a
package that cannot travel to the GPU machine, NCCL's need for a second GPU), so a
reader of the log knows what the check covered without opening the JSON. Exits 0
only when tests ran and none failed.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
import warnings
import xml.etree.ElementTree as ET

RAN = ("passed", "failed", "error")


def read_junit(path: str) -> list[dict]:
    """One record per test case: test id, outcome (passed / failed / error / skipped), seconds, message."""
    tests = []
    try:
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome, message = ("failed" if tag == "failure" else tag), node.get("message", "")
            tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "seconds": float(case.get("time", 0)), "message": message[:500]})
    except (OSError, ET.ParseError) as error:  # pytest killed by the timeout, or did not start
        tests.append({"test": "pytest", "outcome": "error", "seconds": 0.0, "message": str(error)})
    return tests


def summary_lines(tests: list[dict]) -> list[str]:
    """What ran (with each failure's message) and what was skipped and why, one line per test."""
    ran = [t for t in tests if t["outcome"] in RAN]
    skipped = [t for t in tests if t["outcome"] == "skipped"]
    lines = [f"ran {len(ran)} tests:"]
    for test in ran:
        first_line = test["message"].strip().split("\n")[0]
        detail = f": {first_line}" if test["outcome"] != "passed" and first_line else ""
        lines.append(f"  {test['outcome']:<7} {test['test']} ({test['seconds']:.1f} s){detail}")
    lines.append(f"skipped {len(skipped)} tests:")
    for test in skipped:
        reason = test["message"].removeprefix("Skipped: ") or "no reason given"
        lines.append(f"  skipped {test['test']}: {reason}")
    return lines


def environment() -> dict:
    warnings.simplefilter("ignore")  # megatron warns at import that TE and apex are missing
    import torch

    try:
        import megatron.core

        megatron_version = megatron.core.__version__
    except ImportError:
        megatron_version = None
    return {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "megatron_core": megatron_version,
        "importable": {name: importlib.util.find_spec(name) is not None
                       for name in ("transformer_engine", "sglang", "ray")},
    }


def main(argv: list[str]) -> int:
    junit, out, rc, seconds = argv[0], argv[1], int(argv[2]), int(argv[3])
    tests = read_junit(junit)
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in (*RAN, "skipped")}
    report = {
        "ok": rc == 0 and counts["failed"] == 0 and counts["error"] == 0 and counts["passed"] > 0,
        "pytest_exit_code": rc, "seconds": seconds, "counts": counts, "environment": environment(),
        "tests": tests,
    }
    with open(out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"gpu_check: {counts} in {seconds} s -> {out}")
    print("\n".join(summary_lines(tests)))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
