"""--enable-ssl-refresh: reload the server's TLS files into its live `ssl.SSLContext` when they change.

uvicorn builds one `SSLContext` at start and hands it to every listening socket; each new
connection's handshake reads the context's certificate chain then. So reloading is
`load_cert_chain` on that same context: connections already open keep the certificate they
shook hands with, new ones get the new files, and no socket is closed.

The files are polled (their size, mtime and inode, every `interval` seconds) rather than watched:
a certificate renewal is rare, and a poll sees a file replaced by rename as well as one rewritten.
A changed set of files is first loaded into a scratch context: a certificate whose key has not
been written yet (the two files are replaced one after the other) is tried again at the next
poll, and the live context keeps serving the old pair meanwhile.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import anyio

from sonar.log import get_logger

log = get_logger("sonar.tls")


@dataclass(frozen=True)
class TlsFiles:
    certfile: str
    keyfile: str
    ca_certs: str | None = None

    def signature(self) -> tuple[tuple[int, int, int] | None, ...]:
        """What changes when a file is rewritten or replaced (None: the file is missing)."""
        return tuple(_stat(p) for p in (self.certfile, self.keyfile, self.ca_certs) if p)

    def load_into(self, context: ssl.SSLContext) -> None:
        context.load_cert_chain(self.certfile, self.keyfile)
        if self.ca_certs:
            context.load_verify_locations(self.ca_certs)


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class CertRefresher:
    """Keeps `context` loaded with the current contents of `files` (see the module docstring)."""

    def __init__(self, context: ssl.SSLContext, files: TlsFiles, interval: float = 1.0) -> None:
        self.context = context
        self.files = files
        self.interval = interval
        self.loaded = files.signature()
        """The signature of the files the live context holds."""
        self.reloads = 0

    def check(self) -> bool:
        """Reload the live context if the files changed and load cleanly; whether it reloaded."""
        current = self.files.signature()
        if current == self.loaded or None in current:
            return False
        try:
            self.files.load_into(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH))
        except (OSError, ssl.SSLError) as exc:  # half-written: try again at the next poll
            log.warning("tls.reload_deferred", certfile=self.files.certfile, error=str(exc))
            return False
        self.files.load_into(self.context)
        self.loaded = current
        self.reloads += 1
        log.info("tls.reloaded", certfile=self.files.certfile, reloads=self.reloads)
        return True

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            self.check()
