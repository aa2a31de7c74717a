"""msgspec msgpack framing for messages that cross processes.

A message becomes a list of frames: frame 0 is the msgpack payload; every torch tensor or numpy
array inside it is replaced by a small ext record (frame index, dtype, shape) and its bytes travel
as a frame of their own, handed to ZMQ without a copy and rebuilt on the far side as a tensor over
the received buffer. Actor references travel as ext records too, so an actor can be handed a
reference to another one in any process; the node rebuilds one only for a protocol on its
allow-list (`sonar.actors.allow`), never importing a name a peer sent otherwise.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import msgspec
import numpy as np

EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_REF = 3

_DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "complex64",
)


def _torch_dtype(name: str) -> Any:
    import torch  # imported only when a tensor arrives: processes without tensors start faster

    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown tensor dtype {name!r}")
    return getattr(torch, name)


def import_path(obj: Any) -> str:
    """`module:qualname` of a class or function, so another process can import it."""
    return f"{obj.__module__}:{obj.__qualname__}"


class Codec:
    """Encodes and decodes message frames; not thread-safe (one per event loop)."""

    def __init__(self, make_ref: Callable[[str, str | None, str], Any] | None = None) -> None:
        self._out: list[Any] = []
        self._in: list[Any] = []
        self._make_ref = make_ref
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}
        self._meta = msgspec.msgpack.Decoder()

    # -- encoding ---------------------------------------------------------------------------
    def encode(self, obj: Any) -> list[Any]:
        """Frames for `obj`: the msgpack payload first, then one buffer per tensor/array."""
        self._out = []
        try:
            payload = self._encoder.encode(obj)
            return [payload, *self._out]
        finally:
            self._out = []

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # no torch imported: no tensor can be here
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            index = len(self._out) + 1
            if t.numel():
                self._out.append(t.reshape(-1).view(torch.uint8).numpy())
            else:
                self._out.append(b"")
            dtype = str(t.dtype).removeprefix("torch.")
            return msgspec.msgpack.Ext(EXT_TENSOR, self._encoder.encode((index, dtype, list(t.shape))))
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            index = len(self._out) + 1
            self._out.append(a.reshape(-1).view(np.uint8) if a.size else b"")
            return msgspec.msgpack.Ext(EXT_NDARRAY, self._encoder.encode((index, a.dtype.str, list(a.shape))))
        ref_state = getattr(obj, "__sonar_ref__", None)
        if ref_state is not None:
            return msgspec.msgpack.Ext(EXT_REF, self._encoder.encode(ref_state()))
        raise TypeError(f"cannot send a {type(obj).__qualname__} between processes")

    # -- decoding ---------------------------------------------------------------------------
    def decoder(self, type_: Any) -> msgspec.msgpack.Decoder:
        dec = self._decoders.get(type_)
        if dec is None:
            dec = self._decoders[type_] = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook)
        return dec

    def decode(self, frames: list[Any], type_: Any = Any) -> Any:
        """Decode `frames` (payload first; items may be zmq Frames, bytes or memoryviews)."""
        self._in = frames
        payload = frames[0]
        try:
            return self.decoder(type_).decode(getattr(payload, "buffer", payload))
        finally:
            self._in = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_TENSOR:
            import torch

            index, dtype, shape = self._meta.decode(data)
            torch_dtype = _torch_dtype(dtype)
            buf = _buffer(self._in[index])
            if len(buf) == 0:
                return torch.empty(shape, dtype=torch_dtype)
            return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype).reshape(shape)
        if code == EXT_NDARRAY:
            index, dtype, shape = self._meta.decode(data)
            buf = _buffer(self._in[index])
            return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        if code == EXT_REF:
            name, address, protocol = self._meta.decode(data)
            if self._make_ref is None:
                raise ValueError("actor references cannot be decoded here")
            return self._make_ref(name, address, protocol)
        raise ValueError(f"unknown msgpack ext code {code}")


def _buffer(frame: Any) -> Any:
    buf = getattr(frame, "buffer", None)
    buf = memoryview(buf if buf is not None else frame)
    # A tensor over read-only memory (bytes) would be unsafe to hand out: copy those (small) ones.
    return memoryview(bytearray(buf)) if buf.readonly else buf
