"""`sonar.multimodal.media`: every way an image URL is accepted or refused, on real bytes, real
files and a real HTTP server."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest
from PIL import Image

from sonar.errors import InvalidRequestError, SonarError
from sonar.multimodal.limits import ProcessorConfigError
from sonar.multimodal.media import ImageIO, MediaError, MediaPolicy, decode_image, fetch_image_bytes, image_io


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


PICTURE = Image.new("RGB", (12, 9), (200, 30, 40))


def test_media_error_is_a_request_error() -> None:
    assert issubclass(MediaError, InvalidRequestError) and issubclass(MediaError, SonarError)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_urls_of_each_format_decode_to_rgb(fmt: str) -> None:
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(encoded(PICTURE.convert('RGBA') if fmt == 'PNG' else PICTURE, fmt)).decode()}"
    data = anyio.run(fetch_image_bytes, url, MediaPolicy(), "p")
    image = decode_image(data, MediaPolicy(), "p")
    assert image.mode == "RGB" and image.size == (12, 9)


def refused(fn: Any, *args: Any) -> str:
    with pytest.raises(MediaError) as info:
        fn(*args)
    assert info.value.param == "p"
    return str(info.value)


def fetch(url: str, policy: MediaPolicy) -> bytes:
    return anyio.run(fetch_image_bytes, url, policy, "p")


def test_malformed_and_oversized_data_urls() -> None:
    policy = MediaPolicy(max_bytes=1000)
    assert "no ','" in refused(fetch, "data:image/png;base64", policy)
    assert "not an image" in refused(fetch, "data:text/plain;base64,aGk=", policy)
    assert "base64 encoded" in refused(fetch, "data:image/png,abc", policy)
    assert "not valid base64" in refused(fetch, "data:image/png;base64,a$b=", policy)
    big = base64.b64encode(b"x" * 2000).decode()
    assert "larger than 1000 bytes" in refused(fetch, f"data:image/png;base64,{big}", policy)


def test_undecodable_formats_and_bombs() -> None:
    policy = MediaPolicy(max_pixels=100 * 100)
    assert "not an image" in refused(decode_image, b"hello", policy, "p")
    assert "not an image" in refused(decode_image, encoded(PICTURE, "TIFF"), policy, "p")  # not in FORMATS
    noise = Image.frombytes("RGB", (12, 9), bytes(range(256)) * 2)
    truncated = encoded(noise, "PNG")
    assert "malformed" in refused(decode_image, truncated[: len(truncated) // 2], policy, "p")
    assert "101x100 pixels" in refused(decode_image, encoded(Image.new("L", (101, 100)), "PNG"), policy, "p")


def test_local_files_only_under_the_allowed_directory(tmp_path: Path) -> None:
    inside = tmp_path / "allowed"
    inside.mkdir()
    (inside / "a.png").write_bytes(encoded(PICTURE, "PNG"))
    (tmp_path / "secret.png").write_bytes(encoded(PICTURE, "PNG"))
    os.symlink(tmp_path / "secret.png", inside / "link.png")
    policy = MediaPolicy(allowed_local_path=str(inside))
    assert decode_image(fetch(f"file://{inside / 'a.png'}", policy), policy, "p").size == (12, 9)
    assert "outside" in refused(fetch, f"file://{tmp_path / 'secret.png'}", policy)
    assert "outside" in refused(fetch, f"file://{inside}/../secret.png", policy)
    assert "outside" in refused(fetch, f"file://{inside / 'link.png'}", policy)  # a link out of it
    assert "cannot read" in refused(fetch, f"file://{inside / 'missing.png'}", policy)
    assert "no --allowed-local-media-path" in refused(fetch, f"file://{inside / 'a.png'}", MediaPolicy())


@pytest.fixture
def media_server(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "a.png").write_bytes(encoded(PICTURE, "PNG"))
    (tmp_path / "big.bin").write_bytes(b"x" * 5000)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/elsewhere":
                self.send_response(302)
                self.send_header("Location", "http://example.com/a.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_http_only_from_allowed_domains_bounded(media_server: str) -> None:
    allowed = MediaPolicy(allowed_domains=("127.0.0.1",), max_bytes=4000)
    assert decode_image(fetch(f"{media_server}/a.png", allowed), allowed, "p").size == (12, 9)
    assert "no --allowed-media-domains" in refused(fetch, f"{media_server}/a.png", MediaPolicy())
    assert "'127.0.0.1' are not allowed" in refused(
        fetch, f"{media_server}/a.png", MediaPolicy(allowed_domains=("x.org",))
    )
    assert "larger than 4000" in refused(fetch, f"{media_server}/big.bin", allowed)
    assert "HTTP 404" in refused(fetch, f"{media_server}/missing.png", allowed)
    assert "HTTP 302" in refused(fetch, f"{media_server}/elsewhere", allowed)  # redirects are not followed


def test_a_slow_server_times_out() -> None:
    """A server that accepts and never answers: refused after the fetch timeout."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        policy = MediaPolicy(allowed_domains=("127.0.0.1",), fetch_timeout=0.5)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/a.png"
        message = refused(fetch, url, policy)
        assert "longer than 0.5 s" in message or "ReadTimeout" in message
    finally:
        listener.close()


def test_unknown_schemes() -> None:
    assert "data:, file:// or http(s)://" in refused(fetch, "ftp://x/a.png", MediaPolicy())
    assert "non-empty" in refused(fetch, "", MediaPolicy())


def test_rgba_is_laid_over_the_background_color() -> None:
    """As vLLM's image loader: transparent pixels take the background color (white by default),
    opaque ones keep theirs."""
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    data = encoded(rgba, "PNG")
    white = decode_image(data, MediaPolicy(), "p")
    assert white.mode == "RGB" and white.getpixel((0, 0)) == (10, 20, 30) and white.getpixel((1, 0)) == (255, 255, 255)
    blue = decode_image(data, MediaPolicy(image_io=image_io({"image": {"rgba_background_color": [0, 0, 255]}})), "p")
    assert blue.getpixel((0, 0)) == (10, 20, 30) and blue.getpixel((1, 1)) == (0, 0, 255)


def test_image_mode_converts_the_decoded_image() -> None:
    grey = decode_image(encoded(PICTURE, "PNG"), MediaPolicy(image_io=image_io({"image": {"image_mode": "L"}})), "p")
    assert grey.mode == "L" and grey.getpixel((0, 0)) == PICTURE.convert("L").getpixel((0, 0))
    assert image_io(None) == image_io({}) == ImageIO("RGB", (255, 255, 255))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"video": {"num_frames": 40}}, "video settings are not supported: Sonar serves no video"),
        ({"audio": {}}, "audio settings are not supported: Sonar serves no audio"),
        ({"text": {}}, "unknown modality 'text'"),
        ({"image": {"image_mode": "RGB", "size": 3}}, "image size not supported"),
        ({"image": {"image_mode": "Q"}}, "image_mode 'Q' is not one of"),
        ({"image": {"rgba_background_color": [0, 0, 256]}}, "three integers 0 to 255"),
        ({"image": {"rgba_background_color": "white"}}, "three integers 0 to 255"),
        ({"image": "RGB"}, "image must be an object"),
    ],
)
def test_media_io_kwargs_apply_or_are_refused_by_name(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ProcessorConfigError, match=expected):
        image_io(kwargs)
