"""Fetching `image_url` http(s) URLs without letting a client aim the server at its own network.

Rules, checked on every hop (redirects are followed by hand, at most `max_redirects`):
- http and https only;
- every address the host resolves to must be public: loopback, private (RFC 1918, ULA),
  link-local (where cloud metadata services live: 169.254.169.254, fd00:ec2::254), multicast,
  reserved and unspecified addresses are refused unless they fall in `allow_networks`; an IPv6
  address that carries an IPv4 address (mapped, IPv4-compatible, NAT64, 6to4, Teredo) is judged
  by that IPv4 address;
- the connection goes to the address that was checked (the check is the connector's resolver),
  so a name that resolves differently a moment later (DNS rebinding) cannot slip through;
- the body may not exceed `max_bytes` (announced or actual), and the whole fetch, redirects
  included, must finish within `timeout_s`.

Every refusal is an `ImageError` subclass with a `code`, which the frontend turns into a 4xx.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urljoin

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from mmhandoff.media.images import ImageError, ImageTooLarge

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ImageUrlForbidden(ImageError):
    code = "image_url_forbidden"


class ImageFetchFailed(ImageError):
    code = "image_fetch_failed"


@dataclass(frozen=True)
class FetchPolicy:
    allow_networks: tuple[Network, ...] = ()
    max_bytes: int = 32 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 3

    @staticmethod
    def networks(cidrs: list[str] | str | None) -> tuple[Network, ...]:
        """Parse "127.0.0.0/8,10.1.0.0/16" (or a list); a bad entry is a ValueError."""
        if not cidrs:
            return ()
        items = cidrs.split(",") if isinstance(cidrs, str) else cidrs
        return tuple(ipaddress.ip_network(c.strip(), strict=False) for c in items if c.strip())


# IPv6 forms that carry an IPv4 address in their last 32 bits (besides ::ffff:0:0/96, 6to4 and
# Teredo, which `ipaddress` decodes): IPv4-compatible (deprecated) and NAT64's well-known prefix.
_LOW32_CARRIERS = (ipaddress.ip_network("::/96"), ipaddress.ip_network("64:ff9b::/96"))
# NAT64's local-use prefix places the IPv4 address by the operator's prefix length: refused.
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address an IPv6 address reaches through: mapped, IPv4-compatible, NAT64,
    6to4 and Teredo (its server and client)."""
    found = [v4 for v4 in (ip.ipv4_mapped, ip.sixtofour) if v4 is not None]
    found += list(ip.teredo or ())
    if any(ip in net for net in _LOW32_CARRIERS):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def address_allowed(address: str, policy: FetchPolicy) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if any(ip in net for net in policy.allow_networks):
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        embedded = embedded_ipv4(ip)
        if embedded:  # the IPv4 address is where the connection really goes
            return all(address_allowed(str(v4), policy) for v4 in embedded)
    return ip.is_global and not ip.is_multicast


class _GuardedResolver(AbstractResolver):
    """Resolves like the system resolver, then drops every address the policy refuses."""

    def __init__(self, policy: FetchPolicy, what: str = "image") -> None:
        self.policy, self.what = policy, what

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM, family=family)
        except socket.gaierror as e:
            raise ImageFetchFailed(f"cannot resolve {host!r}: {e.strerror}") from None
        refused = [i[4][0] for i in infos if not address_allowed(i[4][0], self.policy)]
        if refused:  # one bad address refuses the name: we do not pick around it
            raise ImageUrlForbidden(f"{self.what} URL host {host!r} resolves to {refused[0]}, "
                                    "which is not a public address (allowed only through the "
                                    "frontend's allow_image_networks)")
        return [ResolveResult(hostname=host, host=i[4][0], port=i[4][1], family=i[0],
                              proto=i[2], flags=socket.AI_NUMERICHOST) for i in infos]

    async def close(self) -> None:
        pass


class ByteBudget:
    """Bytes all the fetches of one request may read together: `max_bytes` bounds each image,
    this bounds the request (eight endless bodies would otherwise each fill `max_bytes`)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise ImageTooLarge(f"the request's image and video URLs are over {self.limit} bytes "
                                "together")


@dataclass
class ImageFetcher:
    policy: FetchPolicy = field(default_factory=FetchPolicy)
    what: str = "image"  # what the URLs are of, as the messages name it ("video": video_url)

    async def fetch(self, url: str, budget: ByteBudget | None = None) -> bytes:
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                return await self._fetch(url, budget or ByteBudget(self.policy.max_bytes))
        except TimeoutError:
            raise ImageFetchFailed(
                f"fetching {url!r} took over {self.policy.timeout_s:g} s") from None

    async def _fetch(self, url: str, budget: ByteBudget) -> bytes:
        connector = aiohttp.TCPConnector(resolver=_GuardedResolver(self.policy, self.what),
                                         use_dns_cache=False)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            for _ in range(self.policy.max_redirects + 1):
                self._check_url(url)
                try:
                    async with session.get(url, allow_redirects=False) as response:
                        if response.status in (301, 302, 303, 307, 308):
                            target = response.headers.get("Location")
                            if not target:
                                raise ImageFetchFailed(f"{url!r} redirects without a Location")
                            url = urljoin(url, target)
                            continue
                        if response.status != 200:
                            raise ImageFetchFailed(f"{url!r} answered HTTP {response.status}")
                        return await self._read(url, response, budget)
                except aiohttp.ClientError as e:
                    raise ImageFetchFailed(f"cannot fetch {url!r}: {e}") from None
            raise ImageFetchFailed(f"{url!r}: more than {self.policy.max_redirects} redirects")

    def _check_url(self, url: str) -> None:
        try:
            parsed = URL(url)
        except ValueError:
            raise ImageFetchFailed(f"not a URL: {url[:100]!r}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ImageUrlForbidden(f"{self.what} URLs must be http(s) with a host, got "
                                    f"{url[:100]!r}")
        try:  # a literal address skips the resolver, so it is checked here
            literal = ipaddress.ip_address(parsed.host.strip("[]"))
        except ValueError:
            return
        if not address_allowed(str(literal), self.policy):
            raise ImageUrlForbidden(f"{self.what} URL address {literal} is not a public address "
                                    "(allowed only through the frontend's allow_image_networks)")

    async def _read(self, url: str, response: aiohttp.ClientResponse,
                    budget: ByteBudget) -> bytes:
        limit = self.policy.max_bytes
        if (response.content_length or 0) > limit:
            raise ImageTooLarge(f"{url!r} is {response.content_length} bytes; the limit is {limit}")
        data = bytearray()
        async for piece in response.content.iter_chunked(1 << 16):
            data += piece
            budget.take(len(piece))
            if len(data) > limit:
                raise ImageTooLarge(f"{url!r} is over the {limit}-byte limit")
        return bytes(data)
