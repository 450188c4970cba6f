"""A worker's watch on its own discovery entry (plane/registration.py), on a scripted runtime."""

from __future__ import annotations

import asyncio

import pytest

from mmhandoff.plane.registration import lost_registration

pytestmark = pytest.mark.unit


class _Runtime:
    """An Endpoint whose discovery lists this process's instance (id 7) at the polls named in
    `present`."""

    def __init__(self, present) -> None:
        self.present, self.polls = present, 0

    async def client(self):
        return self

    def connection_id(self):
        return 7

    def instance_ids(self):
        self.polls += 1
        return [7] if self.present(self.polls) else []


def _why(present, **kw) -> tuple[str, int]:
    rt = _Runtime(present)
    why = asyncio.run(asyncio.wait_for(lost_registration(rt, every_s=0.001, **kw), 10))
    return why, rt.polls


def test_an_instance_that_goes_missing_is_lost():
    why, polls = _why(lambda n: n <= 3, after_s=0.02, first_seen_s=0.01)
    assert why == "lost" and polls > 3  # seen first: the first-seen bound no longer applies


def test_an_instance_that_never_registers_is_reported():
    """It reported ready, but discovery never listed it: nobody would call it."""
    why, _ = _why(lambda n: False, first_seen_s=0.02)
    assert why == "never"


def test_a_present_instance_is_watched_on():
    rt = _Runtime(lambda n: True)

    async def watch():
        task = asyncio.ensure_future(lost_registration(rt, every_s=0.001, after_s=0.01,
                                                       first_seen_s=0.01))
        while rt.polls < 50:
            await asyncio.sleep(0.001)
        assert not task.done()
        task.cancel()

    asyncio.run(watch())
