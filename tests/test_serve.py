"""`mmhandoff serve` runs the disagg graph on one host (no etcd or NATS): it becomes ready, answers
through the official openai client as the in-process path does, and on SIGTERM stops every
process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import openai
import psutil

from tests.conftest import data_uri, encode, free_port, make_image


def test_serve_disagg_graph_and_stop(tmp_path):
    port = free_port()
    log = []
    proc = subprocess.Popen(
        [sys.executable, "-m", "components.cli", "serve", "graphs.disagg:Frontend",
         "-f", "configs/disagg.yaml", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            log.append(line)
            if "[serve] ready" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(400), "".join(log[-40:])
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        uri = data_uri(encode(make_image(160, 120, 81)))
        reply = client.chat.completions.create(
            model="tiny-llava", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                   {"type": "text", "text": "Served?"}]}])
        assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content, (reply, "".join(log[-60:]))
        assert any(line.startswith("[decode_worker-0]") or line.startswith("[prefill_worker-0]")
                   or line.startswith("[frontend-0]") for line in log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, "".join(log[-40:])
    _, alive = psutil.wait_procs(descendants, timeout=15)
    assert not alive, [(p.pid, p.name()) for p in alive]
