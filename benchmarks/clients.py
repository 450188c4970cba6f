"""Third-party clients against the graphs and against plain vLLM's server, on the tiny model.

vLLM's own benchmark client (`vllm bench serve --backend openai-chat --dataset-name random-mm`: a
random image per request, the prompt and answer lengths fixed, `ignore_eos`) runs the same
requests against each arm, one arm up at a time:
- vllm:   `vllm serve <tiny model>` (plain vLLM, one engine);
- agg:    `mmhandoff serve graphs.agg:Frontend -f configs/agg.yaml`;
- disagg: `mmhandoff serve graphs.disagg:Frontend -f configs/disagg.yaml`.
NVIDIA's AIPerf (`aiperf profile --endpoint-type chat --streaming`, a synthetic image per
request) runs next against the same arm when it is installed (`--aiperf PATH`; it pins its own
dependencies, so it lives in a venv of its own: `python -m venv .venv-aiperf &&
.venv-aiperf/bin/pip install aiperf==0.13.0`).
Per arm and client: completed and failed requests, the client's output-token count against the
server's own count (vLLM: `vllm:generation_tokens_total`; mmhandoff:
`mmhandoff_completion_tokens_total`) and the expected requests x output length, request
throughput and TTFT p50; then each arm's ratios to plain vLLM.

    .venv/bin/python benchmarks/clients.py [--requests 24] [--concurrency 4] \
        [--aiperf .venv-aiperf/bin/aiperf]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import port  # noqa: E402

MODEL = "tiny-llava"
VLLM = str(Path(sys.executable).with_name("vllm"))


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and not line.startswith("#"))


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready in {timeout_s:.0f} s")


def start(arm: str, model: str, p: int, log) -> subprocess.Popen:
    env = dict(os.environ, UCX_NET_DEVICES="lo", DYN_LOG="warn",
               VLLM_LOGGING_LEVEL="WARNING")
    if arm == "vllm":
        cmd = [VLLM, "serve", model, "--port", str(p), "--served-model-name", MODEL,
               "--max-model-len", "2048", "--enforce-eager", "--limit-mm-per-prompt",
               '{"image": 1}']
    else:
        cmd = [sys.executable, "-m", "mmhandoff", "serve", f"graphs.{arm}:Frontend", "-f",
               str(ROOT / "configs" / f"{arm}.yaml"), "--port", str(p)]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def bench(url: str, tokenizer: str, args, out: Path) -> dict:
    cmd = [VLLM, "bench", "serve", "--backend", "openai-chat", "--base-url", url,
           "--endpoint", "/v1/chat/completions", "--model", MODEL, "--tokenizer", tokenizer,
           "--dataset-name", "random-mm", "--num-prompts", str(args.requests),
           "--random-input-len", "32", "--random-output-len", str(args.output_len),
           "--random-range-ratio", "0", "--random-mm-base-items-per-request", "1",
           "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
           "--random-mm-bucket-config", "{(336, 448, 1): 1.0}", "--ignore-eos",
           "--max-concurrency", str(args.concurrency), "--seed", "0", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    return json.loads(out.read_text())


def aiperf(binary: str, url: str, tokenizer: str, args, out: Path) -> dict:
    """AIPerf's run against `url`: its summary numbers, in vllm bench serve's key names."""
    cmd = [binary, "profile", "--url", url, "--model", MODEL, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", tokenizer, "--concurrency", str(args.concurrency),
           "--request-count", str(args.requests), "--prompt-input-tokens-mean", "32",
           "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean",
           str(args.output_len), "--prompt-output-tokens-stddev", "0",
           "--image-width-mean", "336", "--image-height-mean", "448", "--image-batch-size", "1",
           "--extra-inputs", "ignore_eos:true", "--random-seed", "0",
           "--output-artifact-dir", str(out), "--ui-type", "none"]
    # not HF_HUB_OFFLINE: AIPerf's offline path looks the tokenizer up in the hub's cache only,
    # while its online path takes a local folder as it is (nothing is downloaded)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    (summary,) = out.rglob("profile_export_aiperf.json")
    m = json.loads(summary.read_text())
    return {"completed": int(m["request_count"]["avg"]),
            "failed": int((m.get("error_request_count") or {}).get("avg", 0)),
            "total_output_tokens": int(m["output_token_count"]["avg"] * m["request_count"]["avg"]),
            "request_throughput": m["request_throughput"]["avg"],
            "duration": m["benchmark_duration"]["avg"],
            "median_e2el_ms": m["request_latency"]["p50"],
            "median_tpot_ms": m["inter_token_latency"]["p50"],
            "median_ttft_ms": m["time_to_first_token"]["p50"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="vllm,agg,disagg")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--aiperf", help="the aiperf command (a venv of its own); absent: skipped")
    args = p.parse_args(argv)
    from mmhandoff.models.tiny import ensure_tiny_model

    model = str(ensure_tiny_model())
    print(f"# vllm bench serve, openai-chat, random-mm (one 336x448 image), {args.requests} "
          f"requests, {args.output_len} tokens each (ignore_eos), concurrency "
          f"{args.concurrency}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mmhandoff-clients-") as tmp:
        for arm in args.arms.split(","):
            p_ = port()
            url = f"http://127.0.0.1:{p_}"
            with open(Path(tmp) / f"{arm}.log", "w") as log:
                proc = start(arm, model, p_, log)
                try:
                    _wait(url, proc)
                    counter = ("vllm:generation_tokens_total" if arm == "vllm"
                               else "mmhandoff_completion_tokens_total")
                    runs = {"vllm bench serve": lambda: bench(
                        url, model, args, Path(tmp) / f"{arm}.json")}
                    if args.aiperf:
                        runs["aiperf"] = lambda: aiperf(args.aiperf, url, model, args,
                                                        Path(tmp) / f"aiperf-{arm}")
                    results = {}
                    for client, run in runs.items():
                        before = _metric(url, counter)
                        results[client] = run(), _metric(url, counter) - before
                finally:
                    proc.send_signal(2)
                    try:
                        proc.wait(timeout=90)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, 9)
                        proc.wait()
            for client, (r, served) in results.items():
                row = {"arm": arm, "client": client, "completed": r["completed"],
                       "failed": r.get("failed", 0),
                       "client_output_tokens": r["total_output_tokens"],
                       "server_output_tokens": served,
                       "expected": args.requests * args.output_len,
                       "req_per_s": round(r["request_throughput"], 2),
                       "ttft_p50_ms": round(r["median_ttft_ms"], 1),
                       "tpot_p50_ms": round(r.get("median_tpot_ms", 0), 1),
                       "duration_s": round(r.get("duration", 0), 1),
                       "e2el_p50_ms": round(r.get("median_e2el_ms", 0), 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    base = {r["client"]: r for r in rows if r["arm"] == "vllm"}
    print("\n| arm | client | req/s ratio to vllm | TTFT p50 ratio to vllm |\n|---|---|---|---|")
    for r in rows:
        if r["arm"] != "vllm" and r["client"] in base:
            b = base[r["client"]]
            print(f"| {r['arm']} | {r['client']} | {r['req_per_s'] / b['req_per_s']:.2f} "
                  f"| {r['ttft_p50_ms'] / b['ttft_p50_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
