"""NixlConnector with a switch for NIXL's progress thread.

NIXL's Python agent starts a progress thread that polls UCX with zero delay (`pthrDelay = 0` in
nixl/_api.py): it spins at 100% of a core even when idle. On a 2-core CPU machine two such engines
leave the model no core, and every request gets ~15x slower. vLLM does not expose the setting, so
this subclass builds the agent without the thread when `kv_connector_extra_config
["progress_thread"]` is false. vLLM then progresses NIXL from its own step loop (transfer status
and notification polling), which is enough for one-sided reads over shared memory / CMA on one
host. Keep the thread (the default on GPUs) where UCX must emulate reads over TCP between hosts:
there the source side has to progress while it is idle.
"""

from __future__ import annotations

import contextlib
import functools

import vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker as _nixl_worker
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector


@contextlib.contextmanager
def _agents_without_progress_thread():
    original = _nixl_worker.nixl_agent_config
    _nixl_worker.nixl_agent_config = functools.partial(original, enable_prog_thread=False)
    try:
        yield
    finally:
        _nixl_worker.nixl_agent_config = original


class MMHandoffNixlConnector(NixlConnector):
    def __init__(self, vllm_config, role, *args, **kwargs) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        quiet = role == KVConnectorRole.WORKER and not extra.get("progress_thread", True)
        with _agents_without_progress_thread() if quiet else contextlib.nullcontext():
            super().__init__(vllm_config, role, *args, **kwargs)
