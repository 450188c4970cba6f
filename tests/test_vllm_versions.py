"""Every vLLM name mmhandoff uses exists in every supported vLLM (0.26 on the lent GPU, 0.31 in
CI), read from each version's source with ast (scripts/vllm_source.py): a name only one version
has fails here, on the CPU, instead of on the first GPU run (issue 33: a name 0.26 lacks broke
every GPU request and nothing that ran on a change noticed)."""

from __future__ import annotations

import pytest

from scripts.vllm_source import (ABSENT, CONTRACT, Source, check, file_uses,
                                 supported_sources, uses)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def sources():
    found = supported_sources()  # the set-up fetched 0.26's source; 0.31 is installed
    assert {"0.26.0", "0.31.0"} <= set(found), found
    return found


def test_every_name_the_code_uses_exists_in_every_supported_version(sources):
    report = check(sources)
    unguarded = [f"vLLM {v}: {u.target} ({u.where}): {why}" for v, u, why in report
                 if not u.guarded]
    assert not unguarded, "\n".join(unguarded)
    # the scan is not vacuous: the adapter's imports, chains and super() hooks were seen
    targets = {u.target for u in uses()}
    assert len(targets) > 40
    assert "vllm.v1.core.sched.scheduler.Scheduler" in targets
    assert "vllm.v1.core.kv_cache_utils._NONE_HASH_SEED" in targets  # a guarded chain


def test_a_name_one_version_lacks_fails_the_check(sources):
    """The regression of issue 33 itself, written unguarded: 0.31 has the name, 0.26 not."""
    code = ("from vllm.v1.core import kv_cache_utils\n"
            "seed = kv_cache_utils._NONE_HASH_SEED\n")
    report = check(sources, file_uses(code, "scratch.py"))
    assert [(v, u.target, u.guarded) for v, u, _ in report] == [
        ("0.26.0", "vllm.v1.core.kv_cache_utils._NONE_HASH_SEED", False)]


def test_a_name_absent_on_purpose_from_the_contract_still_fails_in_code(sources):
    """ABSENT excuses a CONTRACT entry, not the code: code using the name must guard it."""
    (name, versions), = ABSENT.items()
    module, _, attr = name.rpartition(".")
    report = check(sources, file_uses(f"from {module} import {attr}\n", "scratch.py"))
    assert sorted(v for v, _, _ in report) == sorted(versions)


@pytest.mark.parametrize("code", [
    "from vllm.v1.request import RequestStatus\nRequestStatus.NO_SUCH_STATUS\n",
    "from vllm.v1.core.sched.scheduler import Scheduler\n"
    "class S(Scheduler):\n    def schedule(self):\n        return super().no_such_hook()\n",
    "import vllm.v1.engine.core as core\ncore.EngineCoreProc._no_such_step\n",
    "from vllm.distributed.no_such_module import thing\n",
    "from vllm.sampling_params import NoSuchParams\n",
])
def test_a_wrong_name_is_found_in_every_version(sources, code):
    report = check(sources, file_uses(code, "scratch.py"))
    assert sorted(v for v, _, _ in report) == sorted(sources), report
    assert not any(u.guarded for _, u, _ in report)


@pytest.mark.parametrize("code", [
    "from vllm.v1.core import kv_cache_utils\n"
    "x = getattr(kv_cache_utils, '_NONE_HASH_SEED', None)\n",
    "try:\n    from vllm.exceptions import VLLMClientError\nexcept ImportError:\n    pass\n",
    "from vllm.v1.core import kv_cache_utils\n"
    "if hasattr(kv_cache_utils, '_NONE_HASH_SEED'):\n    pass\n",
])
def test_a_guarded_use_is_reported_not_failed(sources, code):
    report = check(sources, file_uses(code, "scratch.py"))
    assert report and all(u.guarded and v == "0.26.0" for v, u, _ in report)


def test_names_that_resolve_through_reexports_bases_and_lazy_imports(sources):
    for root in sources.values():
        tree = Source(root)
        for name in ("vllm.SamplingParams",  # vllm/__init__.py's lazy __getattr__
                     "vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",  # envs' lazy names
                     "vllm.v1.engine.core.EngineCoreProc.step",  # a base class's method
                     "vllm.v1.engine.FinishReason.ERROR"):  # an enum member
            assert tree.missing(name) is None, (root, name)


def test_contract_names_are_checked_and_absences_are_explained(sources):
    assert set(ABSENT) <= set(CONTRACT)
    for name, versions in ABSENT.items():
        for version, why in versions.items():
            assert version in sources and why
            # an absence that is no longer true would hide a real check: drop it
            assert Source(sources[version]).missing(name) is not None, (name, version)


def test_what_prefills_release_of_unclaimed_kv_reads_of_nixls_worker(sources):
    """core.release ends leases in the NIXL connector worker's own book (instance state, which
    the name check cannot see): in every supported version the connector keeps its worker in
    `connector_worker`, the book is `_reqs_to_send` {request id: lease end, perf_counter}, and
    leases past their end are freed from it (0.26 in insertion order: release_held moves the
    ended ones first)."""
    import re

    for version, root in sources.items():
        nixl = root / "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
        worker = (nixl / "base_worker.py").read_text()
        assert "self._reqs_to_send: dict[ReqId, float] = {}" in worker, version
        assert re.search(r"now = time\.perf_counter\(\)[\s\S]{0,400}now >= expires|"
                         r"now = time\.perf_counter\(\)[\s\S]{0,400}now < expires", worker), version
        assert "del self._reqs_to_send[req_id]" in worker, version
        assert "self.connector_worker = " in (nixl / "connector.py").read_text(), version
        args = (root / "vllm/engine/arg_utils.py").read_text()
        assert "worker_extension_cls" in args, version
