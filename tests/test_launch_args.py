"""A component's command line -> the EngineSpec it starts (no engine is started here)."""

from __future__ import annotations

import pytest

from mmhandoff.serving.launch import engine_spec, parser
from mmhandoff.vllm_adapter.engine import engine_env

pytestmark = pytest.mark.unit


def side_channel_host(argv: list[str]) -> str:
    args = parser("prefill").parse_args(["--model", "m", *argv])
    return engine_env(engine_spec(args, "prefill"))["VLLM_NIXL_SIDE_CHANNEL_HOST"]


def test_the_nixl_side_channel_host_is_loopback_unless_told(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    assert side_channel_host([]) == "127.0.0.1"
    assert side_channel_host(["--nixl-host", "10.1.2.3"]) == "10.1.2.3"


def test_in_a_pod_the_side_channel_host_is_the_pods_ip(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.4.0.17")
    assert side_channel_host([]) == "10.4.0.17"
    assert side_channel_host(["--nixl-host", "fd00::5"]) == "fd00::5"  # the flag wins


@pytest.mark.parametrize("bad", ["decode-0.svc", "", "10.0.0.256"])
def test_a_side_channel_host_that_is_not_an_ip_is_refused(monkeypatch, capsys, bad):
    monkeypatch.delenv("POD_IP", raising=False)
    with pytest.raises(SystemExit) as exit_:
        parser("decode").parse_args(["--nixl-host", bad])
    assert exit_.value.code == 2 and "not an IP address" in capsys.readouterr().err
