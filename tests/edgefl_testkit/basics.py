"""Waiting, the CI and release-check switches and what every room may need."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
CHANCE = 0.1  # ten classes in digits


def in_ci() -> bool:
    """CI=true: a missing tool or data set fails its tests instead of skipping them."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


#: the release check's switch (docs/testing.md): set, the tests that the suite runs reduced run at full size
FULL_ENV = "EDGEFL_FULL"


def full_size() -> bool:
    """EDGEFL_FULL=1: the paper-sized and long variants (a release check); unset, the suite's reduced ones, which
    assert the same properties on a smaller workload."""
    return os.environ.get(FULL_ENV, "").strip().lower() not in ("", "0", "false", "no")


def poll(check: Callable[[], T], timeout: float, what: str) -> T:
    """Wait until ``check()`` holds and return its value, or fail saying ``what`` did not happen within ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)  # poll interval, not a synchronisation delay
    return value


def spill_files(directory: Path) -> dict[str, int]:
    """The files this process holds open, unnamed, in ``directory`` (on Linux an O_TMPFILE reads as ``#inode``), with
    their sizes."""
    prefix, found = f"{directory}/", {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith(prefix) and link.endswith(" (deleted)"):
                found[link] = os.fstat(int(fd)).st_size
        except FileNotFoundError:  # closed since the listing (the listing's own descriptor, for one)
            continue
    return found
