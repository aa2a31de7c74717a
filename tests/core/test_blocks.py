from collections.abc import Iterator, Sequence

import pytest

from sonar.core.block_pool import BlockPool
from sonar.core.blocks import BlockManager
from sonar.core.free_queue import FreeBlockQueue, KVBlock
from sonar.core.prefix import PrefixHasher
from sonar.core.request import MAX_CACHE_SALT_LENGTH, Request, RequestRejectedError, cache_salt_problem

BS = 4


@pytest.fixture
def bm() -> Iterator[BlockManager]:
    manager = BlockManager(num_blocks=8, block_size=BS)
    yield manager
    manager.check_invariants()


def make(bm: BlockManager, request_id: str, tokens: Sequence[int], salt: str | None = None) -> Request:
    request = Request(request_id, tokens, max_tokens=100, cache_salt=salt)
    bm.update_hashes(request)
    return request


def admit(bm: BlockManager, request: Request, **kwargs: int) -> int | None:
    """Admit and fully compute ``request``; return its prefix-hit tokens, None if it did not fit."""
    hits, num_hit_tokens = bm.get_computed_blocks(request)
    if not bm.allocate_slots(request, request.num_tokens - num_hit_tokens, new_computed_blocks=hits, **kwargs):
        return None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def grow(bm: BlockManager, request: Request, token: int) -> bool:
    """Append one generated token and make room to compute it (a decode step)."""
    request.output_token_ids.append(token)
    request.all_token_ids.append(token)
    bm.update_hashes(request)
    if not bm.allocate_slots(request, 1):
        return False
    request.num_computed_tokens += 1
    return True


def free_ids(bm: BlockManager) -> list[int]:
    return [block.block_id for block in bm.pool.free_queue]


# The free queue on its own.


def test_free_queue_order_and_o1_removal() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks[:3])
    assert [b.block_id for b in queue] == [0, 1, 2]
    queue.remove(blocks[1])
    queue.append(blocks[3])
    queue.appendleft(blocks[4])
    assert [b.block_id for b in queue] == [4, 0, 2, 3]
    assert len(queue) == 4
    assert queue.popleft() is blocks[4]
    assert queue.check() == [blocks[0], blocks[2], blocks[3]]
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    for _ in range(3):
        queue.popleft()
    with pytest.raises(IndexError, match="no free KV blocks"):
        queue.popleft()
    assert queue.check() == []


def test_pool_refcounts_and_free_positions() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free) == (1, 1, 2)
    pool.cache(a, b"h-a")
    pool.touch([a])
    pool.free([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    pool.free([a])
    # Content-less b jumps the queue; cached a waits at the tail, still findable.
    assert [blk.block_id for blk in pool.free_queue] == [b.block_id, 2, 3, a.block_id]
    assert pool.lookup(b"h-a") is a
    pool.check_invariants()
    with pytest.raises(ValueError, match="cannot allocate 5 blocks"):
        pool.allocate(5)
    got = pool.allocate(4)
    assert got[-1] is a and a.block_hash is None and pool.lookup(b"h-a") is None
    assert pool.num_evictions == 1
    pool.free(got)
    pool.check_invariants()


def test_pool_detects_inconsistency() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    block.ref_cnt = 0
    with pytest.raises(AssertionError, match="is not in the free queue"):
        pool.check_invariants()


# Allocation, growth and freeing.


def test_allocate_and_free(bm: BlockManager) -> None:
    request = make(bm, "a", range(10))
    assert admit(bm, request) == 0
    assert bm.block_ids("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert bm.usage() == pytest.approx(3 / 8)
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
    assert not bm.has_blocks("a")
    bm.free("a")


def test_growth_adds_a_block_only_at_a_boundary(bm: BlockManager) -> None:
    request = make(bm, "a", range(7))
    admit(bm, request)
    assert len(bm.block_ids("a")) == 2
    assert grow(bm, request, 100)  # token 8 fills block 1
    assert len(bm.block_ids("a")) == 2
    assert bm.pool.blocks[bm.block_ids("a")[1]].block_hash == request.block_hashes[1]
    assert grow(bm, request, 101)
    assert len(bm.block_ids("a")) == 3
    bm.check_invariants()
    bm.free("a")


def test_allocation_failure_changes_nothing(bm: BlockManager) -> None:
    first = make(bm, "a", range(16))
    admit(bm, first)
    bm.free("a")  # 4 cached free blocks
    before = (free_ids(bm), dict(bm.pool.cached))
    big = make(bm, "b", list(range(16)) + list(range(100, 120)))  # 9 blocks, 3 of them hits
    assert admit(bm, big) is None
    assert (free_ids(bm), dict(bm.pool.cached)) == before
    assert bm.prefix_queries == 16
    bm.check_invariants()


def test_watermark_and_full_input_reservation(bm: BlockManager) -> None:
    request = make(bm, "a", range(12))  # 3 blocks of 8
    assert admit(bm, request, keep_free_blocks=6) is None
    assert admit(bm, request, keep_free_blocks=5) == 0
    bm.free("a")
    # Only the first chunk (4 tokens) is allocated, but all 40 tokens must fit: 10 > 8 blocks.
    long = make(bm, "b", range(40))
    assert not bm.allocate_slots(long, 4, reserve_tokens=40)
    assert bm.allocate_slots(long, 4, reserve_tokens=32)
    assert len(bm.block_ids("b")) == 1
    bm.free("b")


# Prefix caching.


def test_freed_cached_blocks_stay_findable(bm: BlockManager) -> None:
    first = make(bm, "a", range(10))
    admit(bm, first)
    table = list(bm.block_ids("a"))
    bm.free("a")
    second = make(bm, "b", list(range(8)) + [50, 51, 52])
    assert admit(bm, second) == 8
    assert bm.block_ids("b")[:2] == table[:2]
    assert bm.prefix_queries == 10 + 11 and bm.prefix_hits == 8
    bm.free("b")


def test_last_token_is_always_computed(bm: BlockManager) -> None:
    admit(bm, make(bm, "a", range(12)))
    bm.free("a")
    # Fully cached 8-token prompt: reuse one block, recompute the second for the logits.
    exact = make(bm, "b", range(8))
    hits, num = bm.get_computed_blocks(exact)
    assert num == 4 and len(hits) == 1
    # One token past the cached blocks: reuse both.
    longer = make(bm, "c", range(9))
    assert bm.get_computed_blocks(longer)[1] == 8


def test_free_evicts_the_tail_of_a_request_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    request = make(bm, "a", range(13))  # 3 full cached blocks and a partial one
    admit(bm, request)
    b0, b1, b2, b3 = bm.block_ids("a")
    bm.free("a")
    assert free_ids(bm) == [b3, b2, b1, b0]
    other = make(bm, "x", range(100, 105))  # needs 2 blocks: takes the partial, evicts b2
    admit(bm, other)
    assert bm.block_ids("x") == [b3, b2]
    again = make(bm, "b", range(13))
    bm.free("x")
    assert bm.get_computed_blocks(again)[1] == 8
    bm.check_invariants()


def test_lru_evicts_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b, c = (make(bm, name, range(base, base + 4)) for name, base in zip("abc", (0, 10, 20)))
    for request in (a, b, c):
        admit(bm, request)
    block_a, block_b, block_c = (bm.block_ids(n)[0] for n in "abc")
    bm.free("a")
    bm.free("b")
    bm.free("c")
    # Revive and re-free a's block: it becomes the most recently freed.
    again = make(bm, "a2", list(range(4)) + [9])
    assert admit(bm, again) == 4
    bm.free("a2")
    fresh = make(bm, "f", range(200, 216))  # 4 new blocks: 3 never-cached, then evict one
    admit(bm, fresh)
    assert block_b in bm.block_ids("f")
    assert block_c not in bm.block_ids("f") and block_a not in bm.block_ids("f")
    assert bm.pool.lookup(b.block_hashes[0]) is None
    assert bm.pool.lookup(c.block_hashes[0]) is not None
    assert bm.pool.lookup(a.block_hashes[0]) is not None
    bm.free("f")


def test_siblings_share_prompt_blocks(bm: BlockManager) -> None:
    prompt = list(range(10))
    siblings = [make(bm, f"r-{i}", prompt) for i in range(3)]
    hits = [admit(bm, s) for s in siblings]
    assert hits == [0, 8, 8]
    tables = [bm.block_ids(s.request_id) for s in siblings]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3  # each computes its own partial block
    shared = bm.pool.blocks[tables[0][0]]
    assert shared.ref_cnt == 3
    assert bm.num_free_blocks == 8 - 5
    for i, sibling in enumerate(siblings):
        for token in (1000 + i, 2000 + i):
            assert grow(bm, sibling, token)
    bm.check_invariants()
    # The siblings diverged: their third blocks hold different tokens, so different hashes.
    third = {bm.pool.blocks[bm.block_ids(s.request_id)[2]].block_hash for s in siblings}
    assert len(third) == 3 and None not in third
    bm.free("r-0")
    assert shared.ref_cnt == 2
    bm.free("r-1")
    bm.free("r-2")
    assert shared.ref_cnt == 0 and bm.pool.lookup(siblings[0].block_hashes[0]) is shared


def test_salt_prevents_sharing() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, make(bm, "a", range(9), salt="tenant-1"))
    assert admit(bm, make(bm, "b", range(9), salt="tenant-2")) == 0
    assert admit(bm, make(bm, "c", range(9))) == 0
    assert admit(bm, make(bm, "d", range(9), salt="tenant-1")) == 8
    for name in "abcd":
        bm.free(name)
    bm.check_invariants()


def test_a_salted_request_caches_publishes_and_offloads_only_salted_hashes() -> None:
    """The salt is an extra key of the first block; through the chain every block hash differs
    from the unsalted one, and the KV events and offload chunks carry the salted hashes (and the
    salt as the first block's extra key, so a consumer can recompute them)."""
    bm = BlockManager(num_blocks=16, block_size=BS, kv_events=True, offload_blocks_per_chunk=2)
    hasher = PrefixHasher(BS)
    tokens = list(range(9))
    salted = make(bm, "a", tokens, salt="tenant-1")
    assert salted.block_hashes == hasher.chain(tokens, cache_salt="tenant-1")
    assert not set(salted.block_hashes) & set(hasher.chain(tokens))  # no block matches unsalted
    assert salted.block_hashes[0] == hasher.hash_block(hasher.root, tokens[:BS], ("tenant-1",))
    assert salted.block_hashes[1] == hasher.hash_block(salted.block_hashes[0], tokens[BS : 2 * BS])
    admit(bm, salted)
    [stored] = bm.take_kv_events()
    assert stored.block_hashes == salted.block_hashes and stored.parent_block_hash is None
    assert stored.extra_keys == [["tenant-1"], None]
    bm.free("a", request=salted)
    [chunk] = bm.take_kv_stores()
    assert chunk.block_hashes == salted.block_hashes and chunk.extra_keys == [["tenant-1"], None]
    plain = make(bm, "b", tokens)
    assert admit(bm, plain) == 0  # the salted blocks are cached, and not for it
    bm.free("b")
    bm.check_invariants()


@pytest.mark.parametrize(
    ("salt", "problem"),
    [
        ("", "non-empty"),
        ("x" * (MAX_CACHE_SALT_LENGTH + 1), f"at most {MAX_CACHE_SALT_LENGTH}"),
        (7, "a string"),
    ],
)
def test_an_invalid_salt_is_rejected(salt: object, problem: str) -> None:
    assert problem in (cache_salt_problem(salt) or "")
    with pytest.raises(RequestRejectedError, match=problem):
        Request("r", [1, 2], cache_salt=salt)  # type: ignore[arg-type]
    assert cache_salt_problem(None) is None and cache_salt_problem("x" * MAX_CACHE_SALT_LENGTH) is None


def test_duplicate_content_registers_once(bm: BlockManager) -> None:
    one, two = make(bm, "a", range(8)), make(bm, "b", range(8))
    assert bm.allocate_slots(one, 8) and bm.allocate_slots(two, 8)
    first = [bm.pool.blocks[i] for i in bm.block_ids("a")]
    second = [bm.pool.blocks[i] for i in bm.block_ids("b")]
    assert all(b.block_hash is not None for b in first)
    assert all(b.block_hash is None for b in second)
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.get_computed_blocks(make(bm, "c", range(9)))[0] == first


def test_uncomputed_blocks_leave_the_cache_when_dropped(bm: BlockManager) -> None:
    request = make(bm, "a", range(12))
    assert bm.allocate_slots(request, 12)  # scheduled, not yet computed
    assert len(bm.pool.cached) == 3
    bm.free("a", num_computed_tokens=4)
    assert len(bm.pool.cached) == 1
    assert bm.get_computed_blocks(make(bm, "b", range(13)))[1] == 4


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    first = make(bm, "a", range(9))
    assert first.block_hashes == []
    admit(bm, first)
    assert admit(bm, make(bm, "b", range(9))) == 0
    assert bm.pool.cached == {}
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    bm.free("a")
    bm.free("b")
    bm.check_invariants()


def test_reset_prefix_cache(bm: BlockManager) -> None:
    admit(bm, make(bm, "a", range(9)))
    bm.free("a")
    assert bm.reset_prefix_cache() == 2
    assert admit(bm, make(bm, "b", range(9))) == 0
    bm.free("b")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_hash_algorithms_work_end_to_end(algo: str) -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, hash_algo=algo)
    admit(bm, make(bm, "a", range(9)))
    assert admit(bm, make(bm, "b", range(9))) == 8
    bm.free("a")
    bm.free("b")
    bm.check_invariants()


def test_drop_stale_kv_keeps_the_running_requests_blocks_out_of_the_cache(bm: BlockManager) -> None:
    """After a weight update the cache is empty, and a request that ran across it never enters
    one of its blocks, not even those it fills afterwards; a request admitted after it does."""
    running = make(bm, "a", range(5))
    admit(bm, running)
    assert bm.drop_stale_kv() == 1
    for token in (5, 6, 7, 8):  # fills its second block with the new weights, over old KV
        assert grow(bm, running, token)
    assert not bm.pool.cached
    assert admit(bm, make(bm, "b", range(9))) == 0
    bm.free("a")
    bm.free("b")
    assert admit(bm, make(bm, "c", range(9))) == 8  # b's blocks: the new weights' alone
    bm.free("c")
    bm.check_invariants()
