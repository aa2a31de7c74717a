"""A local HTTP server in the Hugging Face hub's URL layout, for the real download code to run against.

It answers what `huggingface_hub.snapshot_download` asks, as the hub does:

* ``GET /api/models/{repo}/revision/{rev}``: the model info (``sha``, ``siblings``);
* ``GET /api/models/{repo}/tree/{rev}``: the file listing (``path``, ``size``, ``oid``);
* ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: the file, with ``X-Repo-Commit``, ``ETag``
  and ``Content-Length`` (`huggingface_hub.file_download.get_hf_file_metadata` reads them);
* errors with the hub's ``X-Error-Code`` header: ``RepoNotFound``, ``RevisionNotFound``,
  ``EntryNotFound``, and ``GatedRepo`` (401) for a repository whose token was not sent as
  ``Authorization: Bearer <token>``.

Every request is recorded (`Hub.requests`), so a test can tell that none was made.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)
    """Branch or tag name -> commit sha."""
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """Commit sha -> its files (path -> content)."""
    token: str | None = None
    """A gated repository's token; None: public."""

    def add_commit(self, folder: Path, *names: str) -> str:
        """Commit every file under `folder` and point the refs `names` at it; its sha."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for path, content in files.items():
            digest.update(path.encode() + b"\0" + hashlib.sha256(content).digest())
        sha = digest.hexdigest()
        self.commits[sha] = files
        for name in names:
            self.refs[name] = sha
        return sha

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


class Hub:
    """The server and its repositories; `url` is what ``HF_ENDPOINT`` is set to."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)

    def __enter__(self) -> Hub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def repo(self, repo_id: str, token: str | None = None) -> Repo:
        return self.repos.setdefault(repo_id, Repo(token=token))

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append(Request(handler.command, path, handler.headers.get("Authorization")))
        status, headers, content = self._route(path, handler.headers.get("Authorization"))
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        if body:
            handler.wfile.write(content)

    def _route(self, path: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/api/models/"):
            rest = path.removeprefix("/api/models/")
            for verb in ("/revision/", "/tree/"):
                if verb in rest:
                    repo_id, revision = rest.split(verb, 1)
                    return self._api(repo_id, verb.strip("/"), revision, authorization)
        elif "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            revision, _, filename = rest.partition("/")
            return self._file(repo_id, revision, filename, authorization)
        return _error(404, "EntryNotFound", f"no route {path}")

    def _find(
        self, repo_id: str, revision: str, authorization: str | None
    ) -> tuple[Repo, str] | tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository {repo_id} not found")
        if repo.token is not None and authorization != f"Bearer {repo.token}":
            return _error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
        sha = repo.commit_of(revision)
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, sha

    def _api(
        self, repo_id: str, verb: str, revision: str, authorization: str | None
    ) -> tuple[int, dict[str, str], bytes]:
        found = self._find(repo_id, revision.split("/", 1)[0], authorization)
        if isinstance(found[0], int):
            return found  # type: ignore[return-value]
        repo, sha = found  # type: ignore[misc]
        files = repo.commits[sha]
        if verb == "revision":
            info = {"id": repo_id, "modelId": repo_id, "sha": sha, "siblings": [{"rfilename": p} for p in files]}
        else:
            info = [{"type": "file", "path": p, "size": len(c), "oid": _git_oid(c)} for p, c in files.items()]
        return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()

    def _file(
        self, repo_id: str, revision: str, filename: str, authorization: str | None
    ) -> tuple[int, dict[str, str], bytes]:
        found = self._find(repo_id, revision, authorization)
        if isinstance(found[0], int):
            return found  # type: ignore[return-value]
        repo, sha = found  # type: ignore[misc]
        content = repo.commits[sha].get(filename)
        if content is None:
            return _error(404, "EntryNotFound", f"{filename} does not exist at {revision}")
        return 200, {"X-Repo-Commit": sha, "ETag": f'"{_git_oid(content)}"'}, content


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
    return status, headers, json.dumps({"error": message}).encode()


def _git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
