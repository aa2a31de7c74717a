"""`CertRefresher` on real certificates (made by the openssl command line): a live context
reloads when the files change, a half-replaced pair (new certificate, old key) waits for the key,
and a handshake against the live context shows the certificate it holds."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from sonar.http.tls import CertRefresher, TlsFiles


def make_cert(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (EC P-256: quick to make) and its key."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def install(src: tuple[Path, Path], dst: tuple[Path, Path]) -> None:
    """Replace the served files by rename, key first (as a renewal tool would)."""
    for s, d in zip(reversed(src), reversed(dst)):
        tmp = d.with_suffix(".new")
        shutil.copy(s, tmp)
        os.replace(tmp, d)


def served_subject(context: ssl.SSLContext, cafile: Path) -> str:
    """The CN of the certificate a handshake against `context` shows, verified against `cafile`."""
    client = ssl.create_default_context(cafile=str(cafile))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname()) as raw:
                with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                    subject = dict(x[0] for x in tls.getpeercert()["subject"])
        finally:
            thread.join(5)
    return subject["commonName"]


def test_reload_on_change_and_wait_for_a_matching_key(tmp_path: Path) -> None:
    a, b = make_cert(tmp_path, "alpha"), make_cert(tmp_path, "beta")
    live = (tmp_path / "server.crt", tmp_path / "server.key")
    install(a, live)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*live)
    refresher = CertRefresher(context, TlsFiles(str(live[0]), str(live[1])))
    assert not refresher.check()  # unchanged
    assert served_subject(context, a[0]) == "alpha"

    shutil.copy(b[0], live[0])  # the new certificate, the old key: not a pair yet
    assert not refresher.check()
    assert served_subject(context, a[0]) == "alpha"
    shutil.copy(b[1], live[1])
    assert refresher.check() and refresher.reloads == 1
    assert served_subject(context, b[0]) == "beta"
    with pytest.raises(ssl.SSLCertVerificationError):
        served_subject(context, a[0])
