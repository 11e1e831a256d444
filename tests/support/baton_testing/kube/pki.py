"""Certificates and keys of a throwaway control plane, made with the `openssl` command.

One CA signs the API server's serving certificate (for 127.0.0.1 and the in-cluster names) and an
admin client certificate (group `system:masters`); a separate RSA key pair signs and verifies service
account tokens. Everything lives one day: the cluster lives as long as a test session.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

DAYS = "1"
API_SERVER_SANS = ("IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
                   "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local")


@dataclass(frozen=True)
class Pki:
    ca_cert: str
    ca_key: str
    server_cert: str
    server_key: str
    admin_cert: str
    admin_key: str
    sa_key: str  # signs service account tokens (kube-apiserver, kube-controller-manager)
    sa_pub: str  # verifies them (kube-apiserver)


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _ec_key(path: str) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path)


def _signed(directory: str, name: str, subject: str, extensions: list[str], ca_cert: str, ca_key: str) -> None:
    key, csr, cert = (os.path.join(directory, f"{name}.{ext}") for ext in ("key", "csr", "crt"))
    ext_file = os.path.join(directory, f"{name}.ext")
    with open(ext_file, "w") as f:
        f.write("\n".join(extensions) + "\n")
    _ec_key(key)
    _openssl("req", "-new", "-key", key, "-subj", subject, "-out", csr)
    _openssl("x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-days", DAYS,
             "-set_serial", str(secrets.randbits(63)), "-extfile", ext_file, "-out", cert)


def make_pki(directory: str) -> Pki:
    """Write the CA, the serving and admin certificates and the service account keys to `directory`."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the `openssl` command is needed to make the control plane's certificates")
    os.makedirs(directory, exist_ok=True)
    p = lambda name: os.path.join(directory, name)  # noqa: E731
    _ec_key(p("ca.key"))
    _openssl("req", "-x509", "-new", "-key", p("ca.key"), "-subj", "/CN=baton-e2e-ca", "-days", DAYS,
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", p("ca.crt"))
    _signed(directory, "apiserver", "/CN=kube-apiserver",
            [f"subjectAltName={','.join(API_SERVER_SANS)}", "extendedKeyUsage=serverAuth",
             "keyUsage=critical,digitalSignature"], p("ca.crt"), p("ca.key"))
    _signed(directory, "admin", "/O=system:masters/CN=baton-e2e-admin",
            ["extendedKeyUsage=clientAuth", "keyUsage=critical,digitalSignature"], p("ca.crt"), p("ca.key"))
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", p("sa.key"))
    _openssl("pkey", "-in", p("sa.key"), "-pubout", "-out", p("sa.pub"))
    return Pki(p("ca.crt"), p("ca.key"), p("apiserver.crt"), p("apiserver.key"), p("admin.crt"), p("admin.key"),
               p("sa.key"), p("sa.pub"))
