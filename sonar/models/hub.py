"""A hub model id's files: found in the local Hugging Face cache, else downloaded into it.

`snapshot` resolves ``owner/name`` at a revision (a branch, tag or commit; unset: ``main``) to a
snapshot folder of the cache (``--download-dir``, else huggingface_hub's, ``HF_HUB_CACHE``) with
`huggingface_hub.snapshot_download`: it asks the hub (``HF_ENDPOINT``) which commit the revision
names, and downloads the files of that commit the cache lacks, with a progress bar when stderr is
a terminal. Only what Sonar reads is downloaded (`allow_patterns`): the config, tokenizer and
generation files, and the weights of the load format (safetensors; ``.bin`` only for ``pt``; none
for ``dummy``), less the files matching ``--ignore-patterns``. The token is ``--hf-token``, else
``HF_TOKEN`` (or huggingface_hub's stored login).

``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read as the load starts (huggingface_hub reads them
once, when it is imported). With ``HF_HUB_OFFLINE=1`` no request is made: the cache answers or
the load fails.

Every failure is a `ModelLoadError` naming the id, the revision and the cache directory, and
saying what would fix it (the network, the id, a token for a gated or private repository).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from sonar.models.errors import ModelLoadError

log = structlog.get_logger(__name__)

#: What every load reads besides the weights: config, generation defaults, tokenizer and chat
#: template files, and a sentence-transformers folder's pooling settings.
CONFIG_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
SAFETENSORS_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
PT_PATTERNS = ("*.bin", "*.bin.index.json", "*.pt")
TOKENIZER_PATTERNS = tuple(p for p in CONFIG_PATTERNS if p not in ("modules.json", "1_Pooling/config.json"))

#: The weight files each load format downloads (`dummy` none: it builds weights from the config).
WEIGHT_PATTERNS: dict[str, tuple[str, ...]] = {
    "auto": SAFETENSORS_PATTERNS,
    "safetensors": SAFETENSORS_PATTERNS,
    "runai_streamer": SAFETENSORS_PATTERNS,
    "pt": PT_PATTERNS,
    "dummy": (),
}


def allow_patterns(load_format: str) -> list[str]:
    """The files a model load in `load_format` downloads."""
    if load_format not in WEIGHT_PATTERNS:
        raise ModelLoadError(
            f"load_format {load_format} does not download from the hub ({', '.join(WEIGHT_PATTERNS)} do); "
            "download the file and pass its path"
        )
    return [*CONFIG_PATTERNS, *WEIGHT_PATTERNS[load_format]]


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids requests to the hub."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or value.strip().lower() in ("1", "on", "true", "yes")


def endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT``, else huggingface_hub's default."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def cache_root(download_dir: str | Path | None) -> Path:
    """The cache folder a hub id is looked for (and downloaded) in."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    token: str | None = None,
    patterns: Sequence[str] | None,
    ignore_patterns: Sequence[str] = (),
    local_only: bool = False,
) -> Path:
    """The snapshot folder of `repo_id` at `revision` holding the files matching `patterns` (None:
    all) less `ignore_patterns`: from the cache, downloading what it lacks unless offline or
    `local_only`."""
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = cache_root(download_dir)
    no_network = local_only or offline()
    started = time.perf_counter()
    if not no_network:
        log.info("hub.snapshot", repo=repo_id, revision=revision or "main", cache=str(cache), endpoint=endpoint())
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            token=token or None,
            allow_patterns=None if patterns is None else list(patterns),
            ignore_patterns=list(ignore_patterns) or None,
            local_files_only=no_network,
            endpoint=endpoint(),
        )
    except LocalEntryNotFoundError as exc:
        raise _not_cached(repo_id, revision, cache, no_network, exc) from exc
    except HfHubHTTPError as exc:
        raise _refused(repo_id, revision, cache, exc) from exc
    except httpx2.TransportError as exc:  # the connection broke while files were downloading
        raise _not_cached(repo_id, revision, cache, False, exc) from exc
    except OSError as exc:
        raise ModelLoadError(
            f"{_name(repo_id, revision)}: cannot write the Hugging Face cache at {cache}: {exc}"
        ) from exc
    if not no_network:
        log.info("hub.snapshot_ready", repo=repo_id, folder=folder, seconds=round(time.perf_counter() - started, 2))
    return Path(folder)


def _name(repo_id: str, revision: str | None) -> str:
    return f"model {repo_id!r} (revision {revision or 'main'})"


def _not_cached(repo_id: str, revision: str | None, cache: Path, no_network: bool, exc: Exception) -> ModelLoadError:
    name = _name(repo_id, revision)
    if no_network:
        why = "HF_HUB_OFFLINE forbids downloading it: unset HF_HUB_OFFLINE, " if offline() else ""
        return ModelLoadError(
            f"{name} is not a local path and is not in the Hugging Face cache at {cache}; "
            f"{why}download it into that cache (--download-dir), or pass a model directory"
        )
    cause = exc.__cause__ or exc
    return ModelLoadError(
        f"{name} is not in the Hugging Face cache at {cache}, and the hub at {endpoint()} could not be "
        f"reached to download it ({type(cause).__name__}: {_first_line(cause)}): check the network (or "
        "HF_ENDPOINT), or pass a model directory"
    )


def _refused(repo_id: str, revision: str | None, cache: Path, exc: Exception) -> ModelLoadError:
    """The hub answered, with an error: no such repository or revision, gated, or private."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    name = _name(repo_id, revision)
    where = f"(looked for in the Hugging Face cache at {cache})"
    if isinstance(exc, GatedRepoError):
        return ModelLoadError(
            f"{name} is gated on the hub at {endpoint()}: downloading it needs the token of an account "
            f"that was granted access; set HF_TOKEN or pass --hf-token {where}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"{name}: the repository has no revision {revision!r} {where}")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(
            f"{name} was not found on the hub at {endpoint()} {where}: check the id; a private "
            "repository needs a token (HF_TOKEN or --hf-token)"
        )
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return ModelLoadError(f"{name}: the hub at {endpoint()} answered {status}: {_first_line(exc)} {where}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
