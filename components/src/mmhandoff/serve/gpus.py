"""Which GPU each engine replica of a graph runs on, and what share of it (`serve` on one host).

The YAML may say, per component with an engine:
    gpus: [0, 1]      # the GPUs its replicas use, in turn (indices among the GPUs serve may use)
    gpu_share: 0.4    # the fraction of a GPU's memory each of its engines takes when it shares

Without `gpus`, every engine replica gets a GPU of its own while the host has enough; on a host
with fewer GPUs than engines, the replicas take the GPUs in turn and share them. An engine alone
on its GPU keeps vLLM's default share; engines that share one get an explicit share each (the
component's `gpu_share`, an `--engine-arg gpu_memory_utilization=...`, else an equal part of
SHAREABLE). vLLM sizes an engine's KV cache from the memory free while it profiles, so engines
on one GPU must also start one after another (the supervisor waits for each to be ready).
A placement that cannot fit is refused before anything starts, with the arithmetic.

"The GPUs serve may use": those in $CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi
lists; index 0 is the first of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

# What the engines on one GPU may take together: the rest is for each process's CUDA context
# (~0.5 GiB each) and what vLLM allocates outside its budget.
SHAREABLE = 0.9
SHARE_ARG = "gpu_memory_utilization"


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class Slot:
    gpu: str  # the CUDA_VISIBLE_DEVICES value of the replica
    share: float | None  # None: alone on its GPU, vLLM's default
    shared_with: tuple[str, ...] = ()  # the other replicas on this GPU, started before it


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs serve may place engines on (their CUDA_VISIBLE_DEVICES names)."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in listing.splitlines()
                                            if l.startswith("GPU "))]


def place(engines: Sequence[tuple[str, int, Mapping]], gpus: Sequence[str]) -> dict[str, Slot]:
    """{replica name ("<module>-<i>"): its Slot} for `engines`, (module, replicas, the YAML's
    entry for it) in start order, on `gpus`. Empty on a host without GPUs."""
    if not gpus:
        named = [m for m, _, spec in engines if "gpus" in spec or "gpu_share" in spec]
        if named:
            raise PlacementError(f"{', '.join(named)} name GPUs (gpus/gpu_share), but this host "
                                 f"has none (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is "
                                 f"empty)")
        return {}
    named = {m: _named_gpus(m, spec, len(gpus)) for m, _, spec in engines}
    # the replicas placed here go first to the GPUs no component names
    taken = {g for chosen in named.values() if chosen for g in chosen}
    free = [g for g in range(len(gpus)) if g not in taken] or list(range(len(gpus)))
    on: dict[str, int] = {}  # replica -> index into gpus
    turn = 0
    for module, replicas, spec in engines:
        for i in range(replicas):
            if named[module] is not None:
                on[f"{module}-{i}"] = named[module][i % len(named[module])]
            else:  # one each while there are enough, else in turn
                on[f"{module}-{i}"] = free[turn % len(free)]
                turn += 1
    shares = {name: _asked_share(module, spec)
              for module, replicas, spec in engines for name in
              (f"{module}-{i}" for i in range(replicas))}
    slots = {}
    for g in sorted(set(on.values())):
        names = [n for n in on if on[n] == g]  # in start order
        if len(names) == 1:  # alone: vLLM's default (an --engine-arg of the YAML still holds)
            slots[names[0]] = Slot(gpus[g], None)
            continue
        unset = [n for n in names if shares[n] is None]
        given = sum(shares[n] for n in names if shares[n] is not None)
        equal = int((SHAREABLE - given) / len(unset) * 100) / 100 if unset else 0.0
        got = {n: shares[n] if shares[n] is not None else equal for n in names}
        if sum(got.values()) > SHAREABLE + 1e-9 or min(got.values()) <= 0:
            terms = " + ".join(f"{n} {got[n]:.2f}" for n in names)
            raise PlacementError(
                f"GPU {gpus[g]} cannot hold {', '.join(names)}: {terms} = "
                f"{sum(got.values()):.2f} of its memory, and the engines on one GPU may take "
                f"{SHAREABLE} together (the rest is for each process's CUDA context); lower "
                f"their gpu_share, or give them more GPUs (gpus: [...])")
        for k, n in enumerate(names):
            slots[n] = Slot(gpus[g], got[n], tuple(names[:k]))
    return slots


def _named_gpus(module: str, spec: Mapping, count: int) -> list[int] | None:
    if "gpus" not in spec:
        return None
    chosen = spec["gpus"]
    if (not isinstance(chosen, list) or not chosen
            or not all(isinstance(g, int) and not isinstance(g, bool) for g in chosen)):
        raise PlacementError(f"{module}.gpus must be a nonempty list of GPU indices, e.g. "
                             f"[0, 1]; got {chosen!r}")
    outside = [g for g in chosen if not 0 <= g < count]
    if outside:
        raise PlacementError(f"{module}.gpus names {outside}, but serve may use {count} GPU"
                             f"{'s' if count != 1 else ''} here (0..{count - 1})")
    return chosen


def _asked_share(module: str, spec: Mapping) -> float | None:
    """The share the YAML asks for: gpu_share, or an --engine-arg gpu_memory_utilization."""
    args = [str(a) for a in spec.get("args", [])]
    from_args = next((a.split("=", 1)[1] for prev, a in zip([""] + args, args)
                      if prev == "--engine-arg" and a.startswith(f"{SHARE_ARG}=")), None)
    share = spec.get("gpu_share", from_args)
    if share is None:
        return None
    try:
        share = float(share)
    except (TypeError, ValueError):
        share = -1.0
    if not 0 < share <= 1:
        raise PlacementError(f"{module}'s GPU share must be a fraction in (0, 1], got "
                             f"{spec.get('gpu_share', from_args)!r}")
    return share


def share_args(spec: Mapping, slot: Slot | None) -> list[str]:
    """The engine argument that gives a replica its share, unless its YAML gives it already."""
    args = [str(a) for a in spec.get("args", [])]
    if slot is None or slot.share is None or any(a.startswith(f"{SHARE_ARG}=") for a in args):
        return []
    return ["--engine-arg", f"{SHARE_ARG}={slot.share}"]
