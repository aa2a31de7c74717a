"""Loading the images a request names, under the server's media policy.

An ``image_url`` is one of:

* ``data:image/<type>;base64,<data>``: always accepted;
* ``file://<path>``: only under ``--allowed-local-media-path`` (the resolved path, links
  followed, must lie inside the resolved directory); refused when the flag is unset;
* ``http://`` / ``https://``: fetched with httpx only when the host is one of
  ``--allowed-media-domains``, without following redirects (one could leave the domains);
  refused when the flag is unset, so a request cannot make the server reach its own network.

Every source is bounded: at most `MediaPolicy.max_bytes` of encoded image, fetched within
`MediaPolicy.fetch_timeout` seconds, decoded only when its header declares at most
`MediaPolicy.max_pixels` pixels (Pillow's decompression-bomb check, on the header alone), and only
in the formats of `FORMATS`. Anything else is a `MediaError` (an HTTP 400) naming the problem.

A decoded image takes the mode of ``--media-io-kwargs '{"image": {"image_mode": M}}'`` (``RGB`` by
default); an RGBA picture made RGB is laid over ``rgba_background_color`` (white by default), as
vLLM's image loader does (`ImageIO`). The processors then make every mode RGB.

`decode_image` is pure and blocking (call it off the event loop); `fetch_image_bytes` is the
async part (files and HTTP).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from sonar.errors import InvalidRequestError
from sonar.multimodal.limits import ProcessorConfigError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The image formats Pillow may decode for a request."""

MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 4096 * 4096
FETCH_TIMEOUT = 10.0


class MediaError(InvalidRequestError):
    """An image a request names cannot be used: malformed, too large, or not allowed."""


#: The modes ``image_mode`` may name: those the image processors can make RGB of.
IMAGE_MODES = ("RGB", "RGBA", "L", "LA", "P", "CMYK", "YCbCr", "I", "F", "1")


@dataclass(frozen=True)
class ImageIO:
    """How a decoded image is converted (``--media-io-kwargs``' image settings, as vLLM's
    `ImageMediaIO` takes them)."""

    image_mode: str = "RGB"
    rgba_background_color: tuple[int, int, int] = (255, 255, 255)

    def convert(self, image: Any) -> Any:
        """`image` in `image_mode`; RGBA to RGB over the background color."""
        if image.mode == self.image_mode:
            return image
        if image.mode == "RGBA" and self.image_mode == "RGB":
            from PIL import Image

            out = Image.new("RGB", image.size, self.rgba_background_color)
            out.paste(image, mask=image.getchannel("A"))
            return out
        return image.convert(self.image_mode)


#: What --media-io-kwargs may set for images, and why the other modalities are refused.
IMAGE_IO_KWARGS = ("image_mode", "rgba_background_color")
_NO_LOADER = {"video": "Sonar serves no video", "audio": "Sonar serves no audio"}


def image_io(media_io_kwargs: dict[str, Any] | None) -> ImageIO:
    """The image loader settings of ``--media-io-kwargs``; a `ProcessorConfigError` naming any
    modality, key or value Sonar cannot apply."""
    kwargs = dict(media_io_kwargs or {})
    for modality in kwargs:
        if modality != "image":
            why = _NO_LOADER.get(modality, f"unknown modality {modality!r} (image)")
            raise ProcessorConfigError(f"--media-io-kwargs: {modality} settings are not supported: {why}")
    image = kwargs.get("image") or {}
    if not isinstance(image, dict):
        raise ProcessorConfigError(f"--media-io-kwargs: image must be an object of settings, got {image!r}")
    unknown = sorted(set(image) - set(IMAGE_IO_KWARGS))
    if unknown:
        raise ProcessorConfigError(
            f"--media-io-kwargs: image {', '.join(unknown)} not supported (the image loader takes "
            f"{', '.join(IMAGE_IO_KWARGS)})"
        )
    mode = image.get("image_mode", "RGB")
    if mode not in IMAGE_MODES:
        raise ProcessorConfigError(f"--media-io-kwargs: image_mode {mode!r} is not one of {', '.join(IMAGE_MODES)}")
    color = image.get("rgba_background_color", (255, 255, 255))
    if (
        not isinstance(color, list | tuple)
        or len(color) != 3
        or not all(type(c) is int and 0 <= c <= 255 for c in color)
    ):
        raise ProcessorConfigError(
            f"--media-io-kwargs: rgba_background_color must be three integers 0 to 255 (R, G, B), got {color!r}"
        )
    return ImageIO(mode, (color[0], color[1], color[2]))


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    allowed_local_path: str = ""
    """Directory ``file://`` URLs may read under; empty: none."""
    allowed_domains: tuple[str, ...] | None = None
    """Hosts ``http(s)://`` URLs may name; None: none."""
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    fetch_timeout: float = FETCH_TIMEOUT
    image_io: ImageIO = ImageIO()


def _too_large(size: int, policy: MediaPolicy, param: str) -> MediaError:
    return MediaError(f"the image is larger than {policy.max_bytes} bytes (got {size} or more)", param)


def data_url_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The bytes of a ``data:`` URL holding a base64 image."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("the data URL has no ',' before its data", param)
    media_type, *options = header.removeprefix("data:").split(";")
    if not media_type.startswith("image/"):
        raise MediaError(f"the data URL holds {media_type or 'no media type'!r}, not an image", param)
    if "base64" not in options:
        raise MediaError("an image data URL must be base64 encoded (data:image/...;base64,...)", param)
    if len(payload) > (policy.max_bytes + 2) // 3 * 4 + 4:
        raise _too_large(len(payload) * 3 // 4, policy, param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the image data URL is not valid base64", param) from None


def local_file_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The bytes of a ``file://`` URL under the allowed directory."""
    if not policy.allowed_local_path:
        raise MediaError("file:// image URLs are not allowed (the server has no --allowed-local-media-path)", param)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"a file:// image URL names no host, got {parsed.netloc!r}", param)
    root = os.path.realpath(policy.allowed_local_path)
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    if os.path.commonpath([root, path]) != root:
        raise MediaError("the image file is outside the server's --allowed-local-media-path", param)
    try:
        with open(path, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as exc:
        raise MediaError(f"cannot read the image file: {exc.strerror or exc}", param) from None
    if len(data) > policy.max_bytes:
        raise _too_large(len(data), policy, param)
    return data


@functools.cache
def _tls() -> Any:
    """httpx's default TLS context, built once: a client builds its own otherwise, reading the CA
    bundle (~50 ms of CPU, on the event loop) for every image fetched."""
    import httpx

    return httpx.create_ssl_context()


async def http_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The bytes of an ``http(s)://`` image from an allowed domain, size- and time-bounded."""
    host = urllib.parse.urlparse(url).hostname or ""
    if policy.allowed_domains is None:
        raise MediaError("http(s) image URLs are not allowed (the server has no --allowed-media-domains)", param)
    if host.lower() not in {d.lower() for d in policy.allowed_domains}:
        raise MediaError(f"image URLs from {host!r} are not allowed (see --allowed-media-domains)", param)
    import anyio
    import httpx

    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(policy.fetch_timeout):
            async with httpx.AsyncClient(follow_redirects=False, timeout=policy.fetch_timeout, verify=_tls()) as client:
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise MediaError(f"fetching the image returned HTTP {response.status_code}", param)
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > policy.max_bytes:
                            raise _too_large(size, policy, param)
                        chunks.append(chunk)
    except TimeoutError:
        raise MediaError(f"fetching the image took longer than {policy.fetch_timeout:g} s", param) from None
    except httpx.HTTPError as exc:
        raise MediaError(f"cannot fetch the image: {type(exc).__name__}", param) from None
    return b"".join(chunks)


async def fetch_image_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The encoded bytes of the image `url` names (see the module docstring for what is allowed)."""
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string", param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return data_url_bytes(url, policy, param)
    if scheme == "file":
        import anyio

        return await anyio.to_thread.run_sync(local_file_bytes, url, policy, param)
    if scheme in ("http", "https"):
        return await http_bytes(url, policy, param)
    raise MediaError(f"image URLs must be data:, file:// or http(s)://, got {scheme or url[:16]!r}", param)


def decode_image(data: bytes, policy: MediaPolicy, param: str) -> Any:
    """The image in `data` as a `PIL.Image` in the policy's image mode (RGB by default), once its
    header shows an allowed format and size. Blocking: run it off the event loop."""
    import warnings

    from PIL import Image

    if len(data) > policy.max_bytes:
        raise _too_large(len(data), policy, param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > policy.max_pixels:
                raise MediaError(
                    f"the image has {width}x{height} pixels, more than the {policy.max_pixels} allowed", param
                )
            image.load()
            return policy.image_io.convert(image)
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError("the image is a decompression bomb (far more pixels than bytes)", param) from None
    except Image.UnidentifiedImageError:
        raise MediaError(
            f"the image data is not an image in a supported format ({', '.join(FORMATS)})", param
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise MediaError(f"the image data is malformed: {exc}", param) from None
