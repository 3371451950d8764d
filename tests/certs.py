"""A throwaway certificate authority with a server and a client certificate, made with openssl."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(folder: Path) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=cdc test CA", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "cdc_bridge")):
        _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=folder)
        _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext", cwd=folder)
        (folder / f"{name}.key").chmod(0o600)
    return Certs(folder / "ca.crt", folder / "server.crt", folder / "server.key", folder / "client.crt", folder / "client.key")
