"""The CPUs this process may use: its affinity, less a cgroup's CPU quota where one is set.

A container given `limits: {cpu: "4"}` on a 128-core node runs with all 128 cores in its
affinity and a CFS quota of 4 CPUs: sized by the affinity alone, `--media-workers auto` would
start 8 processes to share 4 CPUs' time. The quota is read as Linux exposes it: cgroup v2's
`cpu.max` ("QUOTA PERIOD", or "max"), cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`
(-1: none), in the process's own cgroup and each one above it up to the mount (a limit
anywhere above applies), the tightest one winning. A fraction of a CPU rounds down, to one at
least.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def usable_cores(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                 affinity: int | None = None) -> int:
    """The process's affinity, at most its cgroup CPU quota (rounded down, at least 1)."""
    cores = len(os.sched_getaffinity(0)) if affinity is None else affinity
    quota = cpu_quota(cgroup_root, proc_cgroup)
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def cpu_quota(cgroup_root: Path = CGROUP_ROOT,
              proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota over the process's cgroups, in CPUs; None: no quota (or no
    cgroup file system to read)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            quotas += [_v2(d) for d in _dirs(cgroup_root, path)]
        elif "cpu" in controllers.split(","):
            for mount in V1_CPU_MOUNTS:
                quotas += [_v1(d) for d in _dirs(cgroup_root / mount, path)]
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _dirs(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder and each one above it, up to the mount's own: inside a container the
    mount is often the container's cgroup itself, and the path names the host's view of it."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    dirs = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _ratio(quota, period)


def _v1(folder: Path) -> float | None:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
