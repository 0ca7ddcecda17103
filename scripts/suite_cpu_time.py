"""Where the test suite's time goes: a pytest plugin that records each test's CPU seconds, its own process's and those
of every process it started and waited for (the ranks of a launch included), and a summary of them by module.

The suite keeps both cores of a 2-core machine busy, so a test's cost to the whole run is its CPU time, not its wall
time (a test that waits on a timeout costs little; one whose four ranks compile costs four times their work).

    PYTHONPATH=scripts python -m pytest -n auto --dist loadscope -p suite_cpu_time   # writes /tmp/suite-cpu-time-*.tsv
    python scripts/suite_cpu_time.py [--tests 40]                                   # the summary

SUITE_CPU_TIME_PREFIX moves the files (one per pytest-xdist worker: test, wall, own CPU, children's CPU).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import resource
import time

import pytest

PREFIX = os.environ.get("SUITE_CPU_TIME_PREFIX", "/tmp/suite-cpu-time")


def _cpu_seconds() -> tuple[float, float]:
    """(this process, its waited-for descendants) user + system seconds."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (own, children), started = _cpu_seconds(), time.perf_counter()
    yield
    (own_after, children_after), wall = _cpu_seconds(), time.perf_counter() - started
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{PREFIX}-{worker}.tsv", "a", encoding="utf-8") as file:
        file.write(f"{item.nodeid}\t{wall:.2f}\t{own_after - own:.2f}\t{children_after - children:.2f}\n")


def summary(tests: int) -> None:
    """Total CPU seconds, then each module's and the costliest tests', most first."""
    rows = [line.rstrip("\n").split("\t") for path in sorted(glob.glob(f"{PREFIX}-*.tsv"))
            for line in open(path, encoding="utf-8")]
    cost = [(float(own) + float(children), float(wall), test) for test, wall, own, children in rows]
    by_module = collections.Counter()
    for cpu, _, test in cost:
        by_module[test.split("::")[0]] += cpu
    print(f"{len(cost)} tests, {sum(cpu for cpu, _, _ in cost):.0f} CPU-s in all")
    for module, cpu in by_module.most_common():
        print(f"{cpu:8.1f} CPU-s  {module}")
    print()
    for cpu, wall, test in sorted(cost, reverse=True)[:tests]:
        print(f"{cpu:8.1f} CPU-s {wall:7.1f} s wall  {test}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=40, help="how many of the costliest tests to list")
    summary(parser.parse_args().tests)
