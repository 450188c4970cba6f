"""process.cores: a cgroup's CPU quota bounds what `auto` sizes (media processes, renderer
threads), read from cgroup file trees built here as Linux lays them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmhandoff.media.pool import auto_workers
from mmhandoff.process.cores import cpu_quota, usable_cores

pytestmark = pytest.mark.unit


def tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup mount under tmp_path with `files` (path -> contents) and a /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc").write_text(proc)
    return root, tmp_path / "proc"


@pytest.mark.parametrize("case, proc, files, quota", [
    ("v2, a container's own cgroup (cgroupns)", "0::/\n",
     {"cpu.max": "400000 100000\n"}, 4.0),
    ("v2, no limit", "0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("v2, the limit on a parent of the process's cgroup", "0::/kubepods/pod1/ctr\n",
     {"kubepods/pod1/cpu.max": "250000 100000\n", "kubepods/pod1/ctr/cpu.max": "max 100000\n"},
     2.5),
    ("v2, the tightest of two", "0::/a/b\n",
     {"a/cpu.max": "800000 100000\n", "a/b/cpu.max": "300000 100000\n"}, 3.0),
    ("v2, the host's path absent in the container's mount: the mount's own", "0::/docker/abc\n",
     {"cpu.max": "200000 100000\n"}, 2.0),
    ("v1, cpu,cpuacct mount", "4:cpu,cpuacct:/\n2:memory:/x\n",
     {"cpu,cpuacct/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     1.5),
    ("v1, no limit (-1)", "1:cpu:/\n",
     {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("v1, only other controllers", "2:memory:/x\n", {"memory/x/memory.max": "1\n"}, None),
    ("unreadable values", "0::/\n", {"cpu.max": "lots\n"}, None),
])
def test_the_cpu_quota_as_linux_exposes_it(tmp_path, case, proc, files, quota):
    assert cpu_quota(*tree(tmp_path, proc, files)) == quota, case


def test_the_quota_bounds_the_affinity_rounded_down_to_one_at_least(tmp_path):
    def cores(cpu_max: str, affinity: int) -> int:
        root, proc = tree(tmp_path, "0::/\n", {"cpu.max": cpu_max})
        return usable_cores(root, proc, affinity=affinity)

    assert cores("400000 100000", 128) == 4  # a 4-CPU pod on a 128-core node
    assert cores("250000 100000", 128) == 2
    assert cores("50000 100000", 128) == 1
    assert cores("max 100000", 16) == 16
    assert cores("6400000 100000", 16) == 16  # a quota above the affinity: the affinity
    assert usable_cores(tmp_path / "none", tmp_path / "absent", affinity=8) == 8
    # the media processes `auto` starts on a 4-CPU pod of a large node: none (below 8 cores)
    assert auto_workers(cores("400000 100000", 128)) == 0
    assert auto_workers(cores("1200000 100000", 128)) == 6
