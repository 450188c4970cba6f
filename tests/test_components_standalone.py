"""Each component runs alone (`python -m components.<name>`), as Kubernetes will run it: two
processes find each other through file discovery, answer a handoff, and exit cleanly on SIGTERM
leaving no child process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import msgspec
import psutil

from components.protocol import PrefillRequest
from components.runtime import call, client, runtime
from tests.conftest import chat, data_uri, encode, free_port, make_image
from tests.flows import greedy


def _start(module, *args, env):
    return subprocess.Popen([sys.executable, "-m", module, "--namespace", "standalone", *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_prefill_and_decode_processes(tmp_path, tiny_model):
    env = dict(os.environ, DYN_FILE_KV=str(tmp_path / "discovery"), VLLM_LOGGING_LEVEL="WARNING",
               UCX_NET_DEVICES="lo")
    procs = [
        _start("components.prefill_worker", "--model", tiny_model, "--cpu-cores", "0",
               "--nixl-port", str(free_port()), env=env),
        _start("components.decode_worker", "--model", tiny_model, "--cpu-cores", "1",
               "--nixl-port", str(free_port()), env=env),
    ]
    families = [psutil.Process(p.pid) for p in procs]
    try:
        async def talk():
            os.environ["DYN_FILE_KV"] = env["DYN_FILE_KV"]
            rt = runtime(asyncio.get_running_loop(), discovery="file", request_plane="tcp")
            try:
                p = await client(rt, "standalone.prefill.generate", timeout_s=240)
                d = await client(rt, "standalone.decode.generate", timeout_s=240)
                request = PrefillRequest(request_id="alone", sampling=greedy(8, ignore_eos=True),
                                         messages=chat("Alone?", data_uri(encode(make_image(80, 60, 5)))))
                answers = [a async for a in call(p, msgspec.to_builtins(request))]
                return [c async for c in call(d, answers[0]["handoff"])]
            finally:
                rt.shutdown()

        chunks = asyncio.run(asyncio.wait_for(talk(), 300))
        assert sum(len(c["token_ids"]) for c in chunks) == 8
        assert chunks[-1]["stats"]["kv_tokens_pulled"] > 0
        children = [c for f in families for c in f.children(recursive=True)]
        assert children  # engine cores and workers
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    # orphans (engine cores, workers, multiprocessing's resource tracker) must go away on their
    # own within a bounded time after their parent exits
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [(c.pid, c.name()) for c in alive]
