"""What a component advertises to the other hosts (mmhandoff.plane.addresses)."""

from __future__ import annotations

import pytest

from mmhandoff.plane.addresses import (ADVERTISED_VARS, loopback_warning, remote_planes,
                                         set_advertised_defaults)

pytestmark = pytest.mark.unit


def test_unset_addresses_are_the_pods_else_loopback():
    env = {"POD_IP": "10.1.2.3", "DYN_TCP_RPC_HOST": "10.9.9.9"}
    set_advertised_defaults(env)
    assert [env[v] for v in ADVERTISED_VARS] == ["10.9.9.9", "10.1.2.3", "10.1.2.3"]
    env = {}
    set_advertised_defaults(env)
    assert {env[v] for v in ADVERTISED_VARS} == {"127.0.0.1"}


def test_planes_on_another_host_are_found_in_every_url_form():
    env = {"ETCD_ENDPOINTS": "http://127.0.0.1:2379,http://10.0.0.5:2379",
           "NATS_SERVER": "nats://localhost:4222"}
    assert remote_planes(env) == ["http://10.0.0.5:2379"]
    assert remote_planes({"NATS_SERVER": "nats.dynamo-system.svc:4222"}) == [
        "nats.dynamo-system.svc:4222"]
    assert remote_planes({}) == []


def test_loopback_in_a_multi_host_graph_is_named():
    multi = {"ETCD_ENDPOINTS": "http://10.0.0.5:2379", "DYN_TCP_RPC_HOST": "127.0.0.1",
             "DYN_TCP_RESPONSE_STREAM_HOST": "10.0.0.7", "DYN_EVENT_PLANE_HOST": "10.0.0.7"}
    warning = loopback_warning(multi, nixl_host="127.0.0.1")
    assert warning and "DYN_TCP_RPC_HOST" in warning and "--nixl-host" in warning
    assert "DYN_EVENT_PLANE_HOST," not in warning.split("(")[1].split(")")[0]
    # every address this host's own: nothing to say
    assert loopback_warning({**multi, "DYN_TCP_RPC_HOST": "10.0.0.7"}, "10.0.0.7") is None
    # one host (planes on loopback, or none): loopback is right
    assert loopback_warning({"DYN_TCP_RPC_HOST": "127.0.0.1"}, "127.0.0.1") is None
    assert loopback_warning({"NATS_SERVER": "nats://127.0.0.1:4222",
                             "DYN_TCP_RPC_HOST": "127.0.0.1"}) is None
