"""TLS on the planes that leave a host: the Dynamo request plane (TCP), NATS and etcd.

One certificate authority, and one certificate and key per component (the same pair may serve
every component), given as files (a Kubernetes Secret mounted into the pod, or paths on one
host): a YAML's `tls: {ca, cert, key}` (mmhandoff serve) or the same environment variables set by
hand. The Dynamo runtime reads them (ai-dynamo-runtime 1.6):
- the TCP request plane serves with `cert`/`key`, requires a client certificate signed by `ca`
  (mutual TLS: a peer without one is refused at the handshake), and presents `cert` as a client;
- NATS (a `tls://` URL) and etcd (an `https://` URL) are reached with `ca` as trust and
  `cert`/`key` as the client's identity (NATS' variables name the files, etcd's hold their PEM
  text, as Dynamo reads each).
NIXL's KV transfers are not covered: UCX over TCP has no encryption (docs/security.md says what a
deployment does instead).
"""

from __future__ import annotations

from pathlib import Path


class TlsConfigError(ValueError):
    pass


FIELDS = ("ca", "cert", "key")


def tls_env(tls: dict, *, etcd: str | None = None, nats: str | None = None) -> dict[str, str]:
    """The environment that turns TLS on for a component, from `tls` ({ca, cert, key}: files);
    `etcd` / `nats`: the graph's URLs, if it uses them (each must then say TLS in its scheme)."""
    if not isinstance(tls, dict) or set(tls) != set(FIELDS):
        raise TlsConfigError(f"tls needs exactly {', '.join(FIELDS)} (files), got "
                             f"{sorted(tls) if isinstance(tls, dict) else tls!r}")
    paths = {}
    for name in FIELDS:
        path = Path(str(tls[name])).resolve()
        if not path.is_file():
            raise TlsConfigError(f"tls.{name}: no such file {str(path)!r}")
        paths[name] = str(path)
    return tls_variables(paths["ca"], paths["cert"], paths["key"], etcd=etcd, nats=nats)


def tls_variables(ca: str, cert: str, key: str, *, etcd: str | None = None,
                  nats: str | None = None) -> dict[str, str]:
    """The runtime's variables for these files (not checked: a pod's mount, say; with `etcd`
    they are read, as its variables hold their text)."""
    env = {"DYN_TCP_TLS_CERT_PATH": cert, "DYN_TCP_TLS_KEY_PATH": key,
           "DYN_TCP_TLS_CLIENT_CA_CERT_PATH": ca,  # the server requires client certificates
           "DYN_TCP_TLS_CA_CERT_PATH": ca,
           "DYN_TCP_TLS_CLIENT_CERT_PATH": cert, "DYN_TCP_TLS_CLIENT_KEY_PATH": key}
    if nats:
        if not str(nats).startswith("tls://"):
            raise TlsConfigError(f"with tls, nats must be a tls:// URL, got {nats!r}")
        env.update(NATS_TLS_CA_CERT_PATH=ca, NATS_TLS_CLIENT_CERT_PATH=cert,
                   NATS_TLS_CLIENT_KEY_PATH=key)
    if etcd:
        if not all(url.strip().startswith("https://") for url in str(etcd).split(",")):
            raise TlsConfigError(f"with tls, etcd must be https:// URLs, got {etcd!r}")
        # Dynamo's etcd client takes these variables as the PEM text itself, not as paths (its
        # ClientOptions: `Certificate::from_pem(var)`); given paths, it never connected
        env.update(ETCD_AUTH_CA=Path(ca).read_text(), ETCD_AUTH_CLIENT_CERT=Path(cert).read_text(),
                   ETCD_AUTH_CLIENT_KEY=Path(key).read_text())
    return env
