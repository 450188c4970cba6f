"""The life every component process shares (process/lifecycle.py): why it stops, as its exit
code, for a signal, one of its own ends, or its discovery entry gone; on a scripted endpoint."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from mmhandoff.process import lifecycle

pytestmark = pytest.mark.unit


class _Registered:
    """An endpoint whose instance discovery lists while `listed` says so."""

    def __init__(self, listed: bool = True) -> None:
        self.listed = listed

    async def client(self):
        return self

    def connection_id(self):
        return 7

    def instance_ids(self):
        return [7] if self.listed else []


def _run(coro_of_loop):
    async def main():
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(coro_of_loop(), 10)
        finally:  # the handlers until_stopped left (a second signal during a drain is ignored)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    return asyncio.run(main())


def test_a_stop_signal_ends_it_with_0():
    async def run():
        task = asyncio.ensure_future(lifecycle.until_stopped("t", _Registered()))
        await asyncio.sleep(0)  # it runs up to its first wait: its handlers are in place
        os.kill(os.getpid(), signal.SIGTERM)
        return await task
    assert _run(run) == 0


def test_its_own_end_gives_the_code_and_line_it_means(mmhandoff_log):
    async def run():
        engine_dead = asyncio.ensure_future(asyncio.sleep(0.01))
        never = asyncio.get_running_loop().create_future()
        return await lifecycle.until_stopped("t", _Registered(), {
            never: lambda _: (9, "never this"),
            engine_dead: lambda _: (3, "the engine died"),
        })
    assert _run(run) == 3
    assert "[t] the engine died" in mmhandoff_log.text


def test_out_of_discovery_it_ends_with_1_and_says_why(monkeypatch, mmhandoff_log):
    async def lost(endpoint):
        return "lost"
    monkeypatch.setattr(lifecycle, "lost_registration", lost)
    assert _run(lambda: lifecycle.until_stopped("t", _Registered(listed=False))) == 1
    assert "[t] not in discovery for" in mmhandoff_log.text
