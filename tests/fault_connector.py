"""Test-only NIXL connector that reports a load failure for chosen requests.

Loaded by a decode engine through `kv_connector_module_path`. A request whose id contains
`inject-load-failure` is transferred as usual, but every block it loaded is then reported as
failed, exactly as NIXL reports a transfer error, so vLLM's failure path runs for real.
"""

from mmhandoff.vllm_adapter.core.connector import MMHandoffNixlConnector

MARK = "inject-load-failure"


def _flatten(block_ids):
    for item in block_ids:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield int(item)


class FaultInjectingNixlConnector(MMHandoffNixlConnector):
    def start_load_kv(self, forward_context, **kwargs):
        injected = getattr(self, "_injected", set())
        for req_id, meta in self._connector_metadata.reqs_to_recv.items():
            if MARK in req_id:
                injected.update(_flatten(meta.local_block_ids))
        self._injected = injected
        return super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = set(super().get_block_ids_with_load_errors())
        failed |= getattr(self, "_injected", set())
        self._injected = set()
        return failed
