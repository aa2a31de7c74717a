"""Prefix-cache block hashes: a hash chain over full KV blocks.

The hash of block ``i`` of a sequence covers the hash of block ``i - 1`` (its parent), the
token ids of block ``i`` and optional extra keys. Two sequences therefore get the same hash
for block ``i`` only when their first ``i + 1`` blocks hold the same tokens under the same
extra keys, which is exactly when the KV of that block can be shared. The per-request
``cache_salt`` is an extra key of the first block; through the chain it separates every
later block too, so tenants with different salts never share (or probe) each other's cache. A
request's LoRA adapter is one too (its digest, `first_block_keys`): its KV differs from the base
model's and every other adapter's for the same tokens, and so is LongRoPE's long factor set
(a sequence past the original context rotates its keys otherwise). An image's placeholder tokens are the
same for every image: a block that holds any of them has the image's content hash among its
extra keys (`MediaSpan`), so the same image hits and another image with the same tokens does not.

``--prefix-caching-hash-algo`` picks how the ``(parent, tokens, extra)`` tuple becomes bytes
and how the bytes are hashed:

* ``sha256`` (default): pickle, then SHA-256.
* ``sha256_cbor``: canonical CBOR (reproducible across processes and languages), SHA-256.
* ``xxhash``: pickle, then 128-bit xxHash (XXH3); faster, not cryptographic.
* ``xxhash_cbor``: canonical CBOR, then 128-bit xxHash.

The xxHash variants need the ``xxhash`` package and the CBOR variants ``cbor2``; both are
imported only when chosen. The chain starts from a fixed root derived from the algorithm,
so every process of a deployment computes the same hashes (KV events and offload tiers rely
on that).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Final, Literal, get_args

__all__ = [
    "BlockHash",
    "HASH_ALGOS",
    "HashAlgo",
    "MediaSpan",
    "PrefixHasher",
    "block_keys",
    "first_block_keys",
    "make_hash_fn",
]

BlockHash = bytes

MediaSpan = tuple[int, int, str]
"""An image in a sequence: its first placeholder position, its number of placeholder tokens,
and the hash of its content."""
HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: Final[tuple[str, ...]] = get_args(HashAlgo)

_ROOT_KEY: Final = ("sonar-prefix-cache-root", 1)


def _pickle_bytes(obj: object) -> bytes:
    # A fixed protocol keeps hashes equal across Python versions within one deployment.
    return pickle.dumps(obj, protocol=5)


def _cbor_bytes_fn() -> Callable[[object], bytes]:
    try:
        import cbor2
    except ImportError:
        raise ImportError(
            "the *_cbor prefix caching hash algorithms need the 'cbor2' package: pip install cbor2"
        ) from None

    def encode(obj: object) -> bytes:
        return cbor2.dumps(obj, canonical=True)

    return encode


def _xxhash_fn() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError:
        raise ImportError(
            "the xxhash prefix caching hash algorithms need the 'xxhash' package: pip install xxhash"
        ) from None
    return xxhash.xxh3_128_digest


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def make_hash_fn(algo: str) -> Callable[[object], bytes]:
    """Return ``obj -> digest`` for one of ``HASH_ALGOS``; raise ``ValueError`` otherwise."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")
    serialize = _cbor_bytes_fn() if algo.endswith("_cbor") else _pickle_bytes
    digest = _xxhash_fn() if algo.startswith("xxhash") else _sha256

    def hash_fn(obj: object) -> bytes:
        return digest(serialize(obj))

    return hash_fn


class PrefixHasher:
    """Computes the block hash chain of token sequences for one block size and algorithm."""

    __slots__ = ("algo", "block_size", "root", "_hash")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self._hash = make_hash_fn(algo)
        self.root: BlockHash = self._hash(_ROOT_KEY)
        """The parent hash of every sequence's first block."""

    def hash_block(
        self,
        parent: BlockHash,
        token_ids: Sequence[int],
        extra_keys: tuple[object, ...] | None = None,
    ) -> BlockHash:
        """Hash one full block given its parent's hash, its tokens and its extra keys."""
        return self._hash((parent, tuple(token_ids), extra_keys))

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: str | None = None,
        media: Sequence[MediaSpan] = (),
        long_rope: bool = False,
    ) -> None:
        """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` it lacks.

        ``hashes`` must already hold the chain of the first ``len(hashes)`` blocks of
        ``token_ids``; this is how a request's chain grows as it generates tokens. ``lora``: the
        digest of the request's LoRA adapter; ``media``: the images among its tokens;
        ``long_rope``: its KV is rotated with LongRoPE's long factors.
        """
        bs = self.block_size
        num_full = len(token_ids) // bs
        index = len(hashes)
        parent = hashes[-1] if hashes else self.root
        while index < num_full:
            extra = block_keys(index, bs, cache_salt, lora, media, long_rope)
            parent = self._hash((parent, tuple(token_ids[index * bs : (index + 1) * bs]), extra))
            hashes.append(parent)
            index += 1

    def chain(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: str | None = None,
        media: Sequence[MediaSpan] = (),
        long_rope: bool = False,
    ) -> list[BlockHash]:
        """The hashes of every full block of ``token_ids``."""
        hashes: list[BlockHash] = []
        self.extend(hashes, token_ids, cache_salt, lora, media, long_rope)
        return hashes


def first_block_keys(cache_salt: str | None, lora: str | None, long_rope: bool = False) -> tuple[object, ...] | None:
    """The extra keys of a request's first block: its cache salt, then its LoRA adapter's digest,
    then LongRoPE's long factor set (tagged, so that no salt can equal them); None when it has
    none of them. Keys rotated with the long factors never mix with the short factors' ones."""
    keys: tuple[object, ...] = () if cache_salt is None else (cache_salt,)
    if lora is not None:
        keys += (("lora", lora),)
    if long_rope:
        keys += (("rope", "long"),)
    return keys or None


def block_keys(
    index: int,
    block_size: int,
    cache_salt: str | None,
    lora: str | None,
    media: Sequence[MediaSpan],
    long_rope: bool = False,
) -> tuple[object, ...] | None:
    """The extra keys of block ``index``: the first block's (`first_block_keys`), then the content
    hash of each image with a placeholder token in the block (tagged, in position order)."""
    keys = first_block_keys(cache_salt, lora, long_rope) if index == 0 else None
    start, end = index * block_size, (index + 1) * block_size
    images = tuple(("image", h) for offset, length, h in media if offset < end and offset + length > start)
    if not images:
        return keys
    return (keys or ()) + images
