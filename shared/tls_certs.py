"""A private CA and a server certificate for embedded NATS servers (`kvfabric up
--nats-tls`), made with the `openssl` command line: clients trust the CA file
(`KVF_NATS_TLS_CA`), the servers present the certificate for the addresses they listen on.

For a real deployment bring your own PKI: the servers' `tls {}` block and the CA file are all
kvfabric reads.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DAYS = 825  # the longest validity clients accept for a server certificate


class CertificateError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerTls:
    ca: Path  # what clients trust
    cert: Path
    key: Path

    def config(self) -> str:
        """nats-server's `tls` block for its client port."""
        return f'tls {{ cert_file: "{self.cert}", key_file: "{self.key}", timeout: 2 }}'


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise CertificateError("openssl not found: it makes the NATS servers' certificates")
    done = subprocess.run([binary, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise CertificateError(f"openssl {args[0]} failed: {done.stderr.strip()[-400:]}")


def _subject_alt_names(hosts: Sequence[str]) -> str:
    names = []
    for host in dict.fromkeys([*hosts, "127.0.0.1", "localhost"]):
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


def ensure_server_tls(directory: Path, hosts: Sequence[str]) -> ServerTls:
    """A CA (kept once made) and a certificate for `hosts` signed by it (made again when
    the hosts change), with their keys mode 0600, under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_key, ca = directory / "ca.key", directory / "ca.pem"
    key, cert = directory / "server.key", directory / "server.pem"
    sans = directory / "server.sans"
    if not (ca.exists() and ca_key.exists()):
        _openssl(
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            str(ca_key),
        )
        _openssl(
            "req", "-x509", "-new", "-key", str(ca_key), "-out", str(ca), "-days", str(DAYS),
            "-subj", "/CN=kvfabric NATS CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
    wanted = _subject_alt_names(hosts)
    if not (cert.exists() and key.exists()) or sans.read_text() != wanted:
        csr = directory / "server.csr"
        extensions = directory / "server.ext"
        extensions.write_text(
            f"subjectAltName={wanted}\nextendedKeyUsage=serverAuth\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
        )
        _openssl(
            "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)
        )
        _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", "/CN=kvfabric NATS")
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-out", str(cert), "-days", str(DAYS),
            "-extfile", str(extensions),
        )  # fmt: skip
        csr.unlink()
        sans.write_text(wanted)
    for private in (ca_key, key):
        os.chmod(private, 0o600)
    return ServerTls(ca=ca, cert=cert, key=key)
