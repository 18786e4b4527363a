"""CPU quotas for simulated devices: each client process in a cgroup of its own, under a directory of our own.

cgroup v2 (``cpu.max``) where the cpu controller is delegated to this process's cgroup, else cgroup v1
(``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, the mechanism behind systemd's ``CPUQuota=``). A client with share
``s`` of one core may run ``s x period`` microseconds per period, so its compute takes what that device class would
spend, whatever else the other clients do. The run's directory (``edgefl-<pid>-<hex>``) is made inside this process's
own cgroup, so a limit this process is under also holds for its clients; nothing outside it is written, nothing
kernel-wide is changed, and the directory goes when the run ends (an earlier run's that a crash left behind, empty and
of a process that is gone, is removed on the next start).

A client is put in its cgroup as soon as it started, and its quota is set when every client has registered
(:meth:`CpuLimits.enforce`, before round 1): starting up (importing torch takes seconds of CPU) is not what a fleet's
rounds measure, and at a Pi 3's share it would take minutes here. The quotas together never exceed the cores this
process may use (its CPU affinity, and its own cgroup's quota). The run's directory weighs as much as its clients
would as processes (``cpu.shares`` 1024 or ``cpu.weight`` 100 each), so on a machine shared with other work the fleet
is not squeezed into the weight of one process.
Where no hierarchy can be written, :class:`CpuLimits` says why and the run goes on unenforced; the fallback is an
in-process run (``--in-process``), where each client is measured alone and its compute divided by its share.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger("edgefl.simulate")

PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel's smallest CFS quota
PROC = Path("/proc")
FALLBACK = (
    "device speeds are NOT enforced in this run (client compute is whatever this machine gives each process); the "
    "fallback is --in-process (bench: --mode inprocess), where each client is measured alone and its compute divided "
    "by its profile's share (parallel_clock_s)"
)


class CgroupUnavailable(RuntimeError):
    """No cgroup hierarchy with a cpu controller that this process can write; the message says why."""


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's cgroup lives in a hierarchy that has the cpu controller."""

    version: int  # 1 or 2
    own: Path  # this process's cgroup directory in it


def _mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(root within the hierarchy, mount point, fs type, super options) of every cgroup mount."""
    out = []
    for line in (PROC / "self" / "mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], Path(fields[4]), tail[0], set(tail[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller (``cpu``, ...) and ``""`` for the v2 hierarchy."""
    out: dict[str, str] = {}
    for line in (PROC / "self" / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _inside(mount: Path, root: str, path: str) -> Path:
    rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
    return mount if rel in (".", "") else mount / rel


def find_hierarchy() -> Hierarchy:
    """The hierarchy to put clients in: v2 with cpu delegated to us, else v1's cpu; CgroupUnavailable says why not."""
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read this process's cgroups ({exc})") from None
    why: list[str] = []
    for root, mount, kind, _ in mounts:
        if kind == "cgroup2" and "" in own:
            base = _inside(mount, root, own[""])
            try:
                delegated = "cpu" in (base / "cgroup.subtree_control").read_text().split()
            except OSError:
                delegated = False
            if delegated:
                return Hierarchy(2, base)
            why.append(f"cgroup v2 at {mount} has no cpu controller for {base}")
    for root, mount, kind, options in mounts:
        if kind == "cgroup" and "cpu" in options and "cpu" in own:
            return Hierarchy(1, _inside(mount, root, own["cpu"]))
    why.append("no cgroup v1 hierarchy with the cpu controller is mounted")
    raise CgroupUnavailable("; ".join(why))


def _own_quota_cores(h: Hierarchy) -> float | None:
    """The quota this process's own cgroup is under, in cores (None: unlimited or unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        if h.version == 2:
            quota, period = (h.own / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((h.own / "cpu.cfs_quota_us").read_text())
        return None if quota_us < 0 else quota_us / int((h.own / "cpu.cfs_period_us").read_text())
    return None


def cores_available(h: Hierarchy | None = None) -> float:
    """Cores this process may use: its CPU affinity, and its own cgroup's quota when it has one."""
    cores = float(len(os.sched_getaffinity(0)))
    quota = _own_quota_cores(h) if h is not None else None
    return min(cores, quota) if quota else cores


def _quota(share: float) -> int:
    return max(MIN_QUOTA_US, round(share * PERIOD_US))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CpuLimits:
    """``with CpuLimits(shares) as limits: limits.place(client_id, pid) ... limits.enforce()``: a cgroup per client
    for the block, its quota from ``enforce`` on.

    ``enforced`` is False (and ``reason`` says why) when no cgroup could be written; the methods are then no-ops.
    """

    def __init__(self, shares: dict[str, float]) -> None:
        self.shares = dict(shares)
        self.enforced = False
        self.reason = ""
        self.run_dir: Path | None = None
        self.hierarchy: Hierarchy | None = None
        self._dirs: dict[str, Path] = {}

    def describe(self) -> str:
        """For summary.json and the log: how the quotas were enforced, or why not."""
        if self.enforced and self.hierarchy is not None:
            return f"cgroup v{self.hierarchy.version} CPU quotas in {self.run_dir}"
        return f"not enforced: {self.reason}"

    def __enter__(self) -> CpuLimits:
        try:
            self.hierarchy = find_hierarchy()
        except CgroupUnavailable as exc:
            return self._unenforced(str(exc))
        total, cores = sum(self.shares.values()), cores_available(self.hierarchy)
        if total > cores + 1e-9:
            raise ValueError(
                f"the fleet's CPU shares add up to {total:.2f} cores, more than the {cores:g} this process may use: "
                "use fewer or slower devices, or run --in-process (clients one after another, no quotas needed)"
            )
        self._remove_stale(self.hierarchy.own)
        run_dir = self.hierarchy.own / f"edgefl-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            run_dir.mkdir()
        except OSError as exc:
            return self._unenforced(f"cannot create {run_dir} ({exc.strerror or exc})")
        self.run_dir = run_dir
        try:
            n = len(self.shares)
            if self.hierarchy.version == 2:  # our own directory hands the cpu controller to the clients' cgroups
                (run_dir / "cpu.weight").write_text(str(min(10_000, 100 * n)))
                (run_dir / "cgroup.subtree_control").write_text("+cpu")
            else:
                (run_dir / "cpu.shares").write_text(str(1024 * n))
            for cid in self.shares:
                path = run_dir / cid
                path.mkdir()
                self._dirs[cid] = path
                self._set(cid, None)  # written once now, so a cgroup that refuses quotas is found before any client
        except OSError as exc:
            self._remove()
            return self._unenforced(f"cannot set CPU quotas under {run_dir} ({exc.strerror or exc})")
        self.enforced = True
        return self

    def _set(self, client_id: str, share: float | None) -> None:
        """Write a client's quota (None: unlimited)."""
        path = self._dirs[client_id]
        if self.hierarchy is not None and self.hierarchy.version == 2:
            (path / "cpu.max").write_text(f"{'max' if share is None else _quota(share)} {PERIOD_US}")
        else:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(-1 if share is None else _quota(share)))

    def enforce(self) -> None:
        """Every client's quota from now on (call it once all have started up and registered)."""
        if self.enforced:
            for cid, share in self.shares.items():
                self._set(cid, share)
            log.info("%s: %s", self.describe(), ", ".join(f"{c} {s:.3f} core" for c, s in self.shares.items()))

    def update(self, shares: dict[str, float]) -> None:
        """New quotas for these clients from now on (a device that starts throttling)."""
        self.shares.update(shares)
        if self.enforced:
            for cid, share in shares.items():
                self._set(cid, share)
            log.info("CPU quotas now: %s", ", ".join(f"{c} {s:.3f} core" for c, s in shares.items()))

    def _unenforced(self, reason: str) -> CpuLimits:
        self.enforced, self.reason = False, f"cgroups cannot be written here ({reason})"
        log.warning("%s: %s", self.reason, FALLBACK)
        return self

    def place(self, client_id: str, pid: int) -> None:
        """Move a just-started client process (and every thread it will start) into its cgroup."""
        if self.enforced:
            (self._dirs[client_id] / "cgroup.procs").write_text(str(pid))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._remove()

    def _remove(self, timeout: float = 10.0) -> None:
        """Remove the clients' cgroups and the run's directory (their processes have exited by now)."""
        if self.run_dir is None:
            return
        deadline = time.monotonic() + timeout
        for path in [*self._dirs.values(), self.run_dir]:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while the kernel still counts an exiting process in it
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("could not remove cgroup %s (%s); remove it by hand", path, exc)
                        break
                    time.sleep(0.05)  # poll interval while the kernel releases the exited processes
        self._dirs, self.run_dir = {}, None

    @staticmethod
    def _remove_stale(own: Path) -> None:
        """Empty run directories of ours whose process is gone (a crashed run's); anything else is left alone."""
        for path in own.glob("edgefl-*-*"):
            pid = path.name.split("-")[1]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                for child in path.iterdir():
                    if child.is_dir():
                        child.rmdir()
                path.rmdir()
