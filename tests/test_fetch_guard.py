"""The image URL guard's address rule: an IPv6 address that carries an IPv4 address is judged by
that IPv4 address (HTTP-level cases with loopback targets: test_frontend_request.py)."""

from __future__ import annotations

import ipaddress

import pytest

from mmhandoff.media.fetch import FetchPolicy, address_allowed, embedded_ipv4

pytestmark = pytest.mark.unit

PUBLIC = FetchPolicy()


@pytest.mark.parametrize("v6, v4", [
    ("::ffff:127.0.0.1", "127.0.0.1"),  # IPv4-mapped
    ("::7f00:1", "127.0.0.1"),  # IPv4-compatible
    ("64:ff9b::a9fe:a9fe", "169.254.169.254"),  # NAT64 well-known prefix
    ("2002:a00:1::1", "10.0.0.1"),  # 6to4
])
def test_the_ipv4_inside_is_found_and_decides(v6, v4):
    assert ipaddress.IPv4Address(v4) in embedded_ipv4(ipaddress.IPv6Address(v6))
    assert not address_allowed(v6, PUBLIC)
    assert address_allowed(v6, FetchPolicy(allow_networks=FetchPolicy.networks(v4 + "/32")))


@pytest.mark.parametrize("address", [
    "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1", "2606:4700:4700::1111", "8.8.8.8"])
def test_public_addresses_stay_allowed(address):
    assert address_allowed(address, PUBLIC)


@pytest.mark.parametrize("address", [
    "::1", "::", "2001:0:4136:e378:8000:63bf:80ff:fffe", "64:ff9b:1::808:808", "fd00:ec2::254",
    "fe80::1", "ff02::1"])
def test_loopback_teredo_local_nat64_ula_link_local_and_multicast_are_refused(address):
    assert not address_allowed(address, PUBLIC)
