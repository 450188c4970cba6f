"""Each component runs alone (`python -m mmhandoff.<component>`), as Kubernetes will run it: two
processes find each other through file discovery, answer a handoff, refuse replayed, relabelled,
unsigned, expired and wrongly signed handoffs on the served endpoint (and answer an honest one
for the same image alike afterwards), report ready on Dynamo's system status server, and leave
no child process when they exit or are killed -9. A worker whose engine dies reports not ready and
exits with health.ENGINE_DEAD."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import psutil
import pytest

from mmhandoff.plane.handoff_keys import KEY_ENV
from mmhandoff.plane.runtime import RemoteError, call, client, runtime
from mmhandoff.process.health import ENGINE_DEAD, free_system_port
from mmhandoff.wire.handoff import sign
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import chat, data_uri, encode, free_port, make_image
from tests.flows import greedy, opened, sealed

pytestmark = pytest.mark.graph


def _start(module, *args, env, system_port, log):
    # the log is a file: a pipe nobody reads while the test waits would fill and block the worker
    return subprocess.Popen([sys.executable, "-m", module, "--namespace", "standalone", *args],
                            env={**env, "DYN_SYSTEM_PORT": str(system_port)},
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def _tail(log) -> str:
    return log.read_text()[-3000:]


def _health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status, json.loads(r.read())["status"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["status"]


def _bad_handoffs(used: dict, fresh: dict, other: dict, key: bytes) -> dict[str, dict]:
    """Decode messages: a handoff already used, replayed; a fresh one relabelled with another
    image's features (`other`'s: prefix-cache poisoning); one stripped of its signature, one
    expired, one signed with another key."""
    h = opened(used)
    relabelled = msgspec.structs.replace(opened(fresh), features=opened(other).features)
    return {name: sealed(m) for name, m in {
        "replayed": h,
        "relabelled": relabelled,
        "unsigned": msgspec.structs.replace(h, digest=None, nonce=None, expires_at=None),
        "expired": sign(h, key, ttl_s=-1),
        "wrong key": sign(h, b"k" * 64, ttl_s=60),
    }.items()}


@pytest.fixture
def own_tmpdir():
    """A TMPDIR for the components: the engines' socket folders (vllm_adapter.start_engine),
    which prefill, killed -9 below, cannot remove, go there and not into the machine's /tmp.
    Short: a socket's path must fit 107 bytes (pytest's tmp_path does not leave room)."""
    path = Path(tempfile.mkdtemp(prefix="mmh-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_prefill_and_decode_processes(tmp_path, tiny_model, own_tmpdir):
    key = secrets.token_hex(32)  # as a graph hands it to its components
    env = dict(os.environ, DYN_FILE_KV=str(tmp_path / "discovery"), VLLM_LOGGING_LEVEL="WARNING",
               UCX_NET_DEVICES="lo", TMPDIR=str(own_tmpdir), **{KEY_ENV: key})
    ports = [free_system_port(), free_system_port()]
    procs = [
        _start("mmhandoff.prefill", "--model", tiny_model, "--cpu-cores", "0",
               "--nixl-port", str(free_port()), env=env, system_port=ports[0],
               log=tmp_path / "prefill.log"),
        _start("mmhandoff.decode", "--model", tiny_model, "--cpu-cores", "1",
               "--nixl-port", str(free_port()), env=env, system_port=ports[1],
               log=tmp_path / "decode.log"),
    ]
    families = [psutil.Process(p.pid) for p in procs]
    try:
        async def talk():
            os.environ["DYN_FILE_KV"] = env["DYN_FILE_KV"]
            rt = runtime(asyncio.get_running_loop(), discovery="file", request_plane="tcp")
            try:
                p = await client(rt, "standalone.prefill.generate", timeout_s=240)
                d = await client(rt, "standalone.decode.generate", timeout_s=240)
                def ask(seed: int) -> dict:  # the same question, a different picture
                    return msgspec.to_builtins(PrefillRequest(
                        request_id=f"alone-{seed}", sampling=greedy(8, ignore_eos=True),
                        messages=chat("Alone?", data_uri(encode(make_image(80, 60, seed))))))

                async def handoff(seed: int) -> dict:
                    return {"handoff": [a async for a in call(p, ask(seed))][0]["handoff"]}

                honest = await handoff(5)
                chunks = [c async for c in call(d, honest)]
                # on the served endpoint: each bad handoff is refused with its typed error; the
                # relabelled one is a fresh handoff for picture 5 named as picture 6
                other = await handoff(6)  # prefill's only: decode has not seen picture 6
                refusals = {}
                for name, bad in _bad_handoffs(honest, await handoff(5), other,
                                               key.encode()).items():
                    try:
                        refusals[name] = [c async for c in call(d, bad)]
                    except RemoteError as e:
                        refusals[name] = e.code
                # honest requests afterwards: picture 6's answer is its own (had the relabelled
                # one been taken, decode would reuse picture 5's KV under 6's hash and answer as
                # for 5), and picture 5's is the same as before
                sixth = [c async for c in call(d, other)]
                repeat = [c async for c in call(d, await handoff(5))]
                return chunks, refusals, sixth, repeat
            finally:
                rt.shutdown()

        chunks, refusals, sixth, repeat = asyncio.run(asyncio.wait_for(talk(), 300))
        assert sum(len(c["token_ids"]) for c in chunks) == 7  # after prefill's first token
        assert refusals == {"replayed": "replayed", "relabelled": "digest_mismatch",
                            "unsigned": "unsigned", "expired": "expired",
                            "wrong key": "digest_mismatch"}
        tokens = [t for c in chunks for t in c["token_ids"]]
        assert [t for c in repeat for t in c["token_ids"]] == tokens
        assert [t for c in sixth for t in c["token_ids"]] != tokens
        assert sixth[-1]["stats"]["kv_tokens_pulled"] > 0  # from prefill, not a poisoned cache
        assert chunks[-1]["stats"]["kv_tokens_pulled"] > 0
        children = [c for f in families for c in f.children(recursive=True)]
        assert children  # engine cores and workers
        assert [_health(port) for port in ports] == [(200, "ready")] * 2

        # decode's engine core dies: the worker says not ready, then leaves with ENGINE_DEAD
        (core,) = [c for c in families[1].children() if "EngineCore" in " ".join(c.cmdline())]
        core.kill()
        assert procs[1].wait(timeout=60) == ENGINE_DEAD, _tail(tmp_path / "decode.log")
        assert "engine died" in (tmp_path / "decode.log").read_text()
        assert _health(ports[0]) == (200, "ready")  # prefill is unaffected
        # prefill killed -9 (the OOM killer, a crashed runtime): its engine core dies with it
        # (vllm_adapter/plugins/parent_death.py), and its workers with the engine core
        procs[0].kill()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
    assert [p.returncode for p in procs] == [-signal.SIGKILL, ENGINE_DEAD], [
        _tail(tmp_path / f"{role}.log") for role in ("prefill", "decode")]
    # orphans (engine cores, workers, multiprocessing's resource tracker) must go away on their
    # own within a bounded time after their parent exits, whether it exited or was killed
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [(c.pid, " ".join(c.cmdline())[:120]) for c in alive]
    # what prefill could not remove is in the components' own TMPDIR (removed after the test;
    # before it, the machine's /tmp kept one more folder per run)
    assert list(own_tmpdir.glob("mmhandoff-vllm-ipc-*"))
