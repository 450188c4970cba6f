"""The YAML's `tls` (plane.tls): every plane that leaves the host gets mutual TLS from one CA,
certificate and key, and a config that cannot work is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmhandoff.plane.tls import TlsConfigError, tls_env
from mmhandoff.serve.supervisor import GraphError, runtime_env

pytestmark = pytest.mark.unit


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name in ("ca", "cert", "key"):
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_text(f"-----BEGIN {name}-----\n")
    return {name: str(path) for name, path in paths.items()}


def test_the_request_plane_requires_client_certificates(files):
    env = tls_env(files)
    assert env["DYN_TCP_TLS_CLIENT_CA_CERT_PATH"] == files["ca"]  # mutual: peers must present
    assert (env["DYN_TCP_TLS_CERT_PATH"], env["DYN_TCP_TLS_KEY_PATH"]) == (files["cert"],
                                                                           files["key"])
    assert (env["DYN_TCP_TLS_CLIENT_CERT_PATH"], env["DYN_TCP_TLS_CLIENT_KEY_PATH"]) == (
        files["cert"], files["key"])
    assert not any(k.startswith(("NATS_", "ETCD_")) for k in env)


def test_nats_and_etcd_get_the_same_identity(files):
    env = tls_env(files, nats="tls://10.0.0.2:4222", etcd="https://10.0.0.3:2379")
    assert env["NATS_TLS_CLIENT_CERT_PATH"] == files["cert"]
    assert env["NATS_TLS_CA_CERT_PATH"] == files["ca"]
    # Dynamo's etcd client reads its variables as PEM text (a path made it never connect)
    for var, name in (("ETCD_AUTH_CA", "ca"), ("ETCD_AUTH_CLIENT_CERT", "cert"),
                      ("ETCD_AUTH_CLIENT_KEY", "key")):
        assert env[var] == Path(files[name]).read_text() and env[var].startswith("-----BEGIN")


@pytest.mark.parametrize("change, message", [
    (lambda f: {k: v for k, v in f.items() if k != "key"}, "exactly ca, cert, key"),
    (lambda f: {**f, "ca": f["ca"] + ".missing"}, "tls.ca: no such file"),
    (lambda f: "yes", "exactly ca, cert, key"),
])
def test_a_config_that_cannot_work_is_refused(files, change, message):
    with pytest.raises(TlsConfigError, match=message):
        tls_env(change(files))


def test_a_plain_nats_or_etcd_url_with_tls_is_refused_at_serve(files):
    for config in ({"tls": files, "nats": "nats://127.0.0.1:4222"},
                   {"tls": files, "etcd": "http://127.0.0.1:2379"}):
        with pytest.raises(GraphError, match="tls"):
            runtime_env(config)
    assert "DYN_TCP_TLS_CERT_PATH" not in runtime_env({})  # off unless the YAML says
