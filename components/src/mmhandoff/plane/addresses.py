"""The addresses a component advertises to the others: Dynamo's request and event planes
(`DYN_*_HOST`) and the engine's NIXL side channel (`--nixl-host`).

Each comes from the environment or a flag; unset, `$POD_IP` (Kubernetes: the pod's address from
the downward API), else loopback, the one-host default. A component that advertises loopback
while its etcd or NATS lives on another address is in a multi-host graph where no other host can
reach it: `loopback_warning` says so, naming the variables to set.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Mapping, MutableMapping
from urllib.parse import urlsplit

ADVERTISED_VARS = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST")
PLANE_VARS = ("ETCD_ENDPOINTS", "NATS_SERVER")


def default_host(env: Mapping[str, str] = os.environ) -> str:
    return env.get("POD_IP") or "127.0.0.1"


def set_advertised_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    """Every advertised Dynamo address that is not set: `default_host`."""
    for var in ADVERTISED_VARS:
        env.setdefault(var, default_host(env))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: another host's, as far as we can tell


def remote_planes(env: Mapping[str, str] = os.environ) -> list[str]:
    """The etcd and NATS URLs in `env` that are not on loopback."""
    urls = [u.strip() for var in PLANE_VARS for u in env.get(var, "").split(",") if u.strip()]
    return [u for u in urls if not _is_loopback(urlsplit(u if "//" in u else f"//{u}").hostname
                                                or "")]


def loopback_warning(env: Mapping[str, str] = os.environ,
                     nixl_host: str | None = None) -> str | None:
    """A sentence for stderr when this component advertises loopback in a multi-host graph."""
    remote = remote_planes(env)
    advertised = {var: env[var] for var in ADVERTISED_VARS if env.get(var)}
    if nixl_host is not None:
        advertised["--nixl-host"] = nixl_host
    local = sorted(name for name, host in advertised.items() if _is_loopback(host))
    if not (remote and local):
        return None
    return (f"this component advertises loopback ({', '.join(local)}) while its discovery or "
            f"request plane is on another host ({', '.join(remote)}): no other host can reach "
            f"it. Set POD_IP (or each of {', '.join(ADVERTISED_VARS)} and --nixl-host) to this "
            f"host's address.")
