"""A graph with each component on a host of its own (tests/netns.py): serve's supervisor, its
replicas started through `ip netns exec` with that host's addresses, readiness asked from a
client host. What the replicas print is kept (`log`) instead of relayed."""

from __future__ import annotations

import urllib.error
import urllib.request

from mmhandoff.serve.supervisor import Supervisor, _answers, check_config, load_graph


class HostedGraph(Supervisor):
    """`HostedGraph("graphs.disagg:Frontend", config, hosts, {"frontend": "front", ...},
    client="front")`: a context manager that is ready inside."""

    def __init__(self, target: str, config: dict, hosts, placement: dict[str, str],
                 client: str, ready_s: float = 400) -> None:
        components = load_graph(target)
        check_config(components, config, "(hosted)", target)
        missing = {c.module for c in components} - set(placement)
        if missing:
            raise ValueError(f"no host for {sorted(missing)}")
        super().__init__(components, config, None)
        self.hosts, self.placement, self.client, self.ready_s = hosts, placement, client, ready_s
        self.log: list[str] = []

    def placed(self, component, command, env):
        host = self.placement[component.module]
        if component.module == "frontend":
            command = [*command, "--host", self.hosts.ip(host)]
        return self.hosts.command(host, command), {**env, **self.hosts.env(host)}, \
            self.hosts.ip(host)

    def answers(self, url: str) -> bool:
        return self.hosts.call(self.client, _answers, url)

    def frontend_url(self) -> str:
        return super().frontend_url().replace("127.0.0.1", self.hosts.ip(self.placement["frontend"]))

    def _relay(self, name, proc) -> None:
        for line in proc.stdout:
            self.log.append(f"[{name}] {line}")

    def lines(self, module: str) -> str:
        return "".join(line for line in self.log if line.startswith(f"[{module}-"))

    def health(self) -> dict[str, str]:
        """What each replica's health URL answers now (status and body), asked from the client
        host: the first thing to read when a graph does not get ready."""
        def ask(url: str) -> str:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    return f"{r.status} {r.read()[:400]!r}"
            except urllib.error.HTTPError as e:
                return f"{e.code} {e.read()[:400]!r}"
            except OSError as e:
                return repr(e)
        return {r.name: self.hosts.call(self.client, ask, r.health_url) for r in self.replicas}

    def __enter__(self) -> "HostedGraph":
        self.start()
        try:
            if not self.wait_ready(lambda: False, self.ready_s):
                raise AssertionError(f"not ready: {self.dead() or 'timed out'}; health: "
                                     f"{self.health()}\n" + "".join(
                                         line for line in self.log if "ucp_" not in line
                                         and " | " not in line and "+--" not in line)[-6000:])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
