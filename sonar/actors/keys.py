"""Credentials of the actor transport: who may connect to a node, and how a node proves it.

Every link between actor nodes is authenticated before a single message of it is decoded. A
deployment has:

- one **server** keypair: every node of the deployment binds its ROUTER with it, and connecting
  nodes check that the far side holds it (so a node never talks to a stranger);
- a **client** keypair per machine (or one shared): a node connects with it;
- an **allow-list** of client public keys: a node accepts a connection only from those (and from
  its own client key, which its child processes share).

Links over tcp (and ipc paths a user chose) are CURVE: encrypted, authenticated by key. Links to
a node's private ipc sockets (in a 0700 directory of this user's, see `Node.ipc_address`: a
parent and its child processes) use ZMQ's PLAIN mechanism instead, with the client's public key
as user name and a password derived from the server secret (`link_password`): still checked by
the same ZAP handler against the same allow-list, without encrypting every byte — only this
user (or root) can reach those sockets at all, and CURVE's encryption cost the worker link four
fifths of its tensor throughput.

They come from a directory written by `python -m sonar actor keygen DIR` (`server.key`,
`server.key_secret`, `client.key`, `client.key_secret` and `authorized/*.key`, in the
certificate format of `zmq.auth`), named by `SONAR_ACTOR_KEYS`, `configure(...)`, `sonar actor
--keys DIR` or `sonar serve --actor-keys DIR`; or from the environment as z85 text:
`SONAR_ACTOR_SERVER_SECRET`, `SONAR_ACTOR_CLIENT_SECRET` and `SONAR_ACTOR_AUTHORIZED`
(comma-separated public keys). With none configured, a process makes an *ephemeral* deployment
of its own: its child processes get it through their environment (never their command line), so
parent-child links are authenticated too, and nothing outside the process tree can connect.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from sonar.errors import SonarError

ENV_DIR = "SONAR_ACTOR_KEYS"
ENV_SERVER_SECRET = "SONAR_ACTOR_SERVER_SECRET"
ENV_CLIENT_SECRET = "SONAR_ACTOR_CLIENT_SECRET"
ENV_AUTHORIZED = "SONAR_ACTOR_AUTHORIZED"
INLINE = (ENV_SERVER_SECRET, ENV_CLIENT_SECRET, ENV_AUTHORIZED)


class KeysError(SonarError, ValueError):
    """Credentials that are missing, malformed or unreadable."""


@dataclass(frozen=True)
class Credentials:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized: frozenset[bytes] = field(default_factory=frozenset)
    ephemeral: bool = False
    source: str = ""

    def accepts(self, client_public: bytes) -> bool:
        return client_public == self.client_public or client_public in self.authorized

    @property
    def link_password(self) -> bytes:
        """The PLAIN password of private ipc links: every holder of the server secret knows it."""
        digest = hmac.new(self.server_secret, b"sonar actor ipc link", hashlib.sha256).digest()
        return zmq.utils.z85.encode(digest)

    @classmethod
    def generate(cls) -> "Credentials":
        """A private deployment of this process tree (no key leaves it but to its children)."""
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret, ephemeral=True, source="ephemeral")

    @classmethod
    def from_dir(cls, path: "str | os.PathLike[str]") -> "Credentials":
        root = Path(path)
        if not root.is_dir():
            raise KeysError(f"actor keys: {root} is not a directory (make one: python -m sonar actor keygen {root})")
        _check_private(root)
        server_public, server_secret = _load(root / "server.key_secret")
        client_public, client_secret = _load(root / "client.key_secret")
        authorized = set()
        if (root / "authorized").is_dir():
            authorized = set(zmq.auth.load_certificates(str(root / "authorized")))
        return cls(server_public, server_secret, client_public, client_secret, frozenset(authorized), source=str(root))

    @classmethod
    def from_env(cls, environ: "dict[str, str] | os._Environ[str]") -> "Credentials | None":
        """The credentials the environment names, or None when it names none."""
        if environ.get(ENV_DIR):
            return cls.from_dir(environ[ENV_DIR])
        if not any(environ.get(name) for name in INLINE):
            return None
        try:
            server_secret = _z85(environ.get(ENV_SERVER_SECRET))
            client_secret = _z85(environ.get(ENV_CLIENT_SECRET))
            authorized = frozenset(_z85(k) for k in environ.get(ENV_AUTHORIZED, "").split(",") if k.strip())
        except (ValueError, zmq.ZMQError) as exc:
            raise KeysError(f"actor keys: a {', '.join(INLINE)} value is not a z85 CURVE key: {exc}") from None
        if server_secret is None or client_secret is None:
            raise KeysError(f"actor keys: set both {ENV_SERVER_SECRET} and {ENV_CLIENT_SECRET}")
        return cls(
            zmq.curve_public(server_secret),
            server_secret,
            zmq.curve_public(client_secret),
            client_secret,
            authorized,
            source="environment",
        )

    def to_env(self) -> dict[str, str]:
        """These credentials as environment variables (how a child process gets them)."""
        return {
            ENV_SERVER_SECRET: self.server_secret.decode(),
            ENV_CLIENT_SECRET: self.client_secret.decode(),
            ENV_AUTHORIZED: ",".join(sorted(k.decode() for k in self.authorized)),
        }


_current: Credentials | None = None


def configure(keys: "Credentials | str | os.PathLike[str] | None") -> Credentials | None:
    """Set this process's credentials (a keys directory or `Credentials`; None: back to the
    environment, else ephemeral). Sockets opened afterwards use them."""
    global _current
    _current = keys if isinstance(keys, Credentials) or keys is None else Credentials.from_dir(keys)
    return _current


def current() -> Credentials:
    """This process's credentials: configured, else named by the environment, else ephemeral."""
    global _current
    if _current is None:
        _current = Credentials.from_env(os.environ) or Credentials.generate()
    return _current


def take_from_env() -> Credentials | None:
    """Read the credentials a parent passed in the environment and remove them from it, so
    processes this one starts (compilers, tokenizer pools) do not inherit the secrets."""
    creds = Credentials.from_env(os.environ)
    for name in INLINE:
        os.environ.pop(name, None)
    if creds is not None:
        configure(creds)
    return creds


def keygen(directory: "str | os.PathLike[str]", name: str | None = None) -> Path:
    """Write a deployment's keys into `directory` (mode 0700): the server keypair unless it is
    there already, a client keypair unless there already, and the client's public key in
    `authorized/<name>.key`. Returns the directory."""
    root = Path(directory)
    umask = os.umask(0o077)  # no moment when another user could read a secret file
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        (root / "authorized").mkdir(mode=0o700, exist_ok=True)
        if not (root / "server.key_secret").exists():
            zmq.auth.create_certificates(str(root), "server")
        if not (root / "client.key_secret").exists():
            zmq.auth.create_certificates(str(root), "client")
        label = name or socket.gethostname()
        shutil.copyfile(root / "client.key", root / "authorized" / f"{label}.key")
    finally:
        os.umask(umask)
    return root


def _load(secret_file: Path) -> tuple[bytes, bytes]:
    if not secret_file.exists():
        raise KeysError(f"actor keys: {secret_file} is missing")
    try:
        public, secret = zmq.auth.load_certificate(str(secret_file))
    except (OSError, ValueError) as exc:
        raise KeysError(f"actor keys: cannot read {secret_file}: {exc}") from None
    if secret is None:
        raise KeysError(f"actor keys: {secret_file} holds no secret key")
    return public, secret


def _check_private(root: Path) -> None:
    """Secret key files readable by other users are refused, as ssh refuses such a key."""
    for secret in root.glob("*.key_secret"):
        if secret.stat().st_mode & 0o077:
            raise KeysError(f"actor keys: {secret} is readable by other users (chmod 600 it)")


def _z85(text: str | None) -> bytes | None:
    if not text:
        return None
    raw = text.strip().encode()
    if len(raw) != 40:
        raise ValueError(f"{len(raw)} characters, expected 40")
    zmq.utils.z85.decode(raw)
    return raw
