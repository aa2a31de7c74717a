import hashlib
import pickle

import pytest

from sonar.core.prefix import HASH_ALGOS, PrefixHasher, block_keys

ALGOS = list(HASH_ALGOS)


@pytest.mark.parametrize("algo", ALGOS)
def test_same_prefix_same_hashes(algo: str) -> None:
    hasher = PrefixHasher(4, algo)
    a = hasher.chain(list(range(12)) + [99, 98])
    b = hasher.chain(list(range(12)) + [7])
    assert len(a) == len(b) == 3
    assert a == b
    assert len(set(a)) == 3


@pytest.mark.parametrize("algo", ALGOS)
def test_chain_depends_on_every_earlier_block(algo: str) -> None:
    hasher = PrefixHasher(4, algo)
    base = hasher.chain(list(range(12)))
    changed = hasher.chain([100] + list(range(1, 12)))
    assert all(x != y for x, y in zip(base, changed))
    changed_last = hasher.chain(list(range(11)) + [100])
    assert changed_last[:2] == base[:2] and changed_last[2] != base[2]


@pytest.mark.parametrize("algo", ALGOS)
def test_salt_separates_the_whole_chain(algo: str) -> None:
    hasher = PrefixHasher(4, algo)
    tokens = list(range(16))
    plain = hasher.chain(tokens)
    salted = hasher.chain(tokens, cache_salt="tenant-a")
    other = hasher.chain(tokens, cache_salt="tenant-b")
    assert hasher.chain(tokens, cache_salt="tenant-a") == salted
    for x, y, z in zip(plain, salted, other):
        assert len({x, y, z}) == 3


def test_algorithms_differ() -> None:
    tokens = list(range(8))
    chains = {algo: PrefixHasher(4, algo).chain(tokens) for algo in HASH_ALGOS}
    assert len({c[0] for c in chains.values()}) == len(chains) == 4
    assert len(chains["xxhash"][0]) == 16
    assert len(chains["sha256"][0]) == 32


def test_sha256_is_pickle_then_sha256() -> None:
    hasher = PrefixHasher(2, "sha256")
    expected = hashlib.sha256(pickle.dumps((hasher.root, (5, 6), None), protocol=5)).digest()
    assert hasher.chain([5, 6]) == [expected]
    assert hasher.hash_block(hasher.root, [5, 6]) == expected


def test_cbor_variant_is_reproducible_bytes() -> None:
    import cbor2

    hasher = PrefixHasher(2, "sha256_cbor")
    payload = cbor2.dumps((hasher.root, (5, 6), ("salt",)), canonical=True)
    assert hasher.chain([5, 6], cache_salt="salt") == [hashlib.sha256(payload).digest()]


def test_extend_only_adds_new_full_blocks() -> None:
    hasher = PrefixHasher(4)
    tokens = list(range(6))
    hashes = hasher.chain(tokens)
    assert len(hashes) == 1
    first = hashes[0]
    tokens += [6, 7, 8]
    hasher.extend(hashes, tokens)
    assert hashes[0] is first and len(hashes) == 2
    assert hashes == hasher.chain(tokens)


def test_root_is_stable_across_instances() -> None:
    assert PrefixHasher(4).root == PrefixHasher(16).root
    assert PrefixHasher(4).chain([1, 2, 3, 4]) == PrefixHasher(4).chain([1, 2, 3, 4])


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="unknown prefix caching hash algorithm 'md5'"):
        PrefixHasher(4, "md5")


def test_an_adapter_separates_the_whole_chain_from_the_salt_and_the_base() -> None:
    hasher = PrefixHasher(4)
    tokens = list(range(12))
    base = hasher.chain(tokens)
    adapter = hasher.chain(tokens, lora="d1")
    assert hasher.chain(tokens, lora="d1") == adapter
    other = hasher.chain(tokens, lora="d2")
    salted = hasher.chain(tokens, cache_salt="d1")  # a salt equal to a digest is still not the adapter
    both = hasher.chain(tokens, cache_salt="s", lora="d1")
    for blocks in zip(base, adapter, other, salted, both):
        assert len(set(blocks)) == 5
    assert hasher.chain(tokens, cache_salt="s") == hasher.chain(tokens, cache_salt="s", lora=None)


def test_longropes_long_factor_set_separates_the_whole_chain() -> None:
    """Keys rotated with LongRoPE's long factors are another KV than the short factors' ones."""
    hasher = PrefixHasher(4)
    tokens = list(range(12))
    short, long, salted_long = [], [], []
    hasher.extend(short, tokens)
    hasher.extend(long, tokens, long_rope=True)
    hasher.extend(salted_long, tokens, cache_salt="s", long_rope=True)
    assert short == hasher.chain(tokens) and long == hasher.chain(tokens, long_rope=True)
    for blocks in zip(short, long, salted_long):
        assert len(set(blocks)) == 3
    assert block_keys(0, 4, None, None, (), long_rope=True) == (("rope", "long"),)


def test_an_image_keys_the_blocks_that_hold_its_tokens() -> None:
    """Blocks 1 and 2 hold tokens of the image at positions 6..9: the same image, the same
    hashes; another image, the same chain up to them and another from them on."""
    hasher = PrefixHasher(4)
    tokens = list(range(100, 116))
    plain = hasher.chain(tokens)
    same = hasher.chain(tokens, media=[(6, 4, "aa")])
    assert same == hasher.chain(tokens, media=[(6, 4, "aa")])
    other = hasher.chain(tokens, media=[(6, 4, "bb")])
    assert same[0] == other[0] == plain[0]
    assert len({same[1], other[1], plain[1]}) == 3
    assert same[3] != other[3]  # through the chain
    assert block_keys(1, 4, "salt", None, [(6, 4, "aa")]) is not None
    assert block_keys(3, 4, None, None, [(6, 4, "aa")]) is None
    assert block_keys(0, 4, "s", None, [(2, 4, "aa")]) == ("s", ("image", "aa"))
