"""Prompts given as their input embeddings (--enable-prompt-embeds).

A prompt is then ``{"prompt_embeds": tensor}`` (vLLM's shape of it): a float tensor
``[tokens, hidden_size]`` (or ``[1, tokens, hidden_size]``) holding what the model's embedding
layer would give for each prompt position (`model.embed`, with any scaling the model applies
there). Over HTTP it is the base64 of the tensor written by ``torch.save`` (`load_serialized`).

The engine runs it like a token prompt of the same length whose ids are placeholders
(`PLACEHOLDER`): the scheduler budgets and caches those positions as usual, and the worker feeds
the embeddings in place of the placeholders' (`NewRequestData.prompt_embeds` travels with the
request each time the worker is told of it, after a preemption or a restart too). So that no two
different embeddings share cached KV, the request's prefix-cache salt is a hash of them
(`embeds_salt`): identical embeddings still share it. The outputs are real tokens.

What needs the prompt's tokens is refused with it: prompt logprobs (and so `echo`), and the
prompt takes no part in `repetition_penalty` nor reaches logits processors as token ids.

Untrusted input: ``torch.save`` files are pickles, and loading a pickle runs code, so
`load_serialized` reads only a zip-format file, whose members' declared sizes stay within what a
prompt of the context's length may take (no decompression bomb), with ``torch.load(...,
weights_only=True)`` (a restricted unpickler: tensors and plain containers, nothing callable),
onto the CPU; the tensor must then be dense, floating point and finite, with the model's hidden
size and no more rows than the context.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import zipfile
from typing import TYPE_CHECKING, Any, Mapping

from sonar.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

PLACEHOLDER = 0
"""The token id a position given as an embedding carries through the scheduler."""

#: Bytes a torch.save file adds around its tensor data (pickle, names, alignment): generous.
_FILE_OVERHEAD = 64 * 1024


def is_embeds_prompt(prompt: Any) -> bool:
    return isinstance(prompt, Mapping)


def check_prompt_embeds(prompt: Mapping[str, Any], hidden_size: int, max_model_len: int) -> torch.Tensor:
    """The prompt's embeddings as a float32 CPU tensor ``[tokens, hidden_size]``, or a 400 naming
    what is wrong with them."""
    extra = set(prompt) - {"prompt_embeds"}
    if extra:
        raise InvalidRequestError(f"an embeddings prompt takes only prompt_embeds, not {sorted(extra)}", "prompt")
    return check_rows(prompt.get("prompt_embeds"), hidden_size, max_model_len, "prompt_embeds")


def check_rows(embeds: Any, hidden_size: int, max_rows: int, param: str) -> torch.Tensor:
    """`embeds` (first-layer inputs: a prompt's, an image's) as a finite float32 CPU tensor
    ``[rows, hidden_size]`` with 1 to `max_rows` rows, or a 400 naming `param`."""
    import torch

    if not isinstance(embeds, torch.Tensor):
        raise InvalidRequestError(f"{param} must be a tensor, got {type(embeds).__name__}", param)
    if embeds.layout is not torch.strided or embeds.is_quantized or not embeds.dtype.is_floating_point:
        raise InvalidRequestError(
            f"{param} must be a dense floating-point tensor, got {embeds.dtype} ({embeds.layout})", param
        )
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise InvalidRequestError(
            f"{param} must have the shape [tokens, {hidden_size}] (the model's hidden size), got {list(embeds.shape)}",
            param,
        )
    if not 1 <= embeds.shape[0] <= max_rows:
        raise InvalidRequestError(
            f"{param} must have between 1 and {max_rows} rows (the context), got {embeds.shape[0]}", param
        )
    embeds = embeds.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise InvalidRequestError(f"{param} must be finite (no NaN or infinity)", param)
    return embeds


def load_serialized(text: str, hidden_size: int, max_model_len: int) -> torch.Tensor:
    """The prompt embeddings in `text`: base64 of a ``torch.save`` file (see the module docstring)."""
    return check_prompt_embeds(
        {"prompt_embeds": read_tensor(text, max_model_len * hidden_size, "prompt_embeds")}, hidden_size, max_model_len
    )


def read_tensor(text: str, max_values: int, param: str) -> Any:
    """What the ``torch.save`` file whose base64 is `text` holds, read safely (see the module
    docstring): a 400 naming `param` if it is not base64 of a zip-format file whose members take
    at most what `max_values` float64 values take, or if the restricted unpickler refuses it."""
    import torch

    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{param} must be base64 (of a torch.save file)", param) from None
    limit = max_values * 8 + _FILE_OVERHEAD
    buffer = io.BytesIO(raw)
    try:
        with zipfile.ZipFile(buffer) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, ValueError):
        raise InvalidRequestError(f"{param} is not a torch.save file (zip format)", param) from None
    if declared > limit:
        raise InvalidRequestError(f"{param} unpacks to {declared} bytes, more than {max_values} values take", param)
    buffer.seek(0)
    try:
        return torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as exc:  # a hostile or broken file: whatever the unpickler says, it is a 400
        raise InvalidRequestError(
            f"{param} could not be read as a tensor ({type(exc).__name__}): only plain tensors are accepted", param
        ) from None


def embeds_salt(data: bytes, salt: str | None) -> str:
    """The prefix-cache salt of an embeddings prompt: a hash of the embeddings and of the
    client's own salt, if any (of a fixed length, whatever the client's)."""
    h = hashlib.sha256(data)
    if salt is not None:
        h.update(b"\0salt:" + salt.encode())
    return "embeds:" + h.hexdigest()
