from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import assert_no_leak, make_block_manager


def test_allocate_grows_and_free_returns_everything():
    bm = make_block_manager(num_blocks=8, block_size=4)
    assert bm.can_allocate("a", 9)
    table = bm.allocate("a", 9)
    assert len(table) == 3 and bm.num_used_blocks == 3
    assert bm.allocate("a", 12) == table  # still fits in 3 blocks
    assert len(bm.allocate("a", 13)) == 4
    bm.free("a")
    assert_no_leak(bm)


def test_can_allocate_refuses_beyond_the_pool_and_honours_the_watermark():
    bm = make_block_manager(num_blocks=10, block_size=4, watermark=0.2)  # 2 blocks held back
    assert bm.can_allocate("a", 40)
    assert not bm.can_allocate("a", 41)
    assert not bm.can_allocate("a", 40, reserve=True)
    assert bm.can_allocate("a", 32, reserve=True)


def test_prefix_hits_share_blocks_and_refcounts():
    bm = make_block_manager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    bm.allocate("a", len(tokens))
    bm.cache_full_blocks("a", tokens, len(tokens))  # blocks 0 and 1 are full
    hits = bm.get_computed_blocks(tokens + [99])
    assert hits == bm.block_ids("a")[:2]
    bm.allocate("b", 11, hits)
    assert bm.block_ids("b")[:2] == hits
    assert [bm.ref_counts[b] for b in hits] == [2, 2]
    bm.check_invariants()
    bm.free("a")
    assert [bm.ref_counts[b] for b in hits] == [1, 1]
    bm.free("b")
    assert_no_leak(bm)
    assert len(bm.evictable) == 2  # cached content survives the requests


def test_a_hit_always_leaves_one_token_to_compute():
    bm = make_block_manager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", tokens, 8)
    assert len(bm.get_computed_blocks(tokens)) == 1  # not 2: the last token must produce logits
    bm.free("a")


def test_different_prefix_does_not_hit():
    bm = make_block_manager(num_blocks=8, block_size=4)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", list(range(8)), 8)
    assert bm.get_computed_blocks([7] + list(range(1, 9))) == []
    # Same second block, different first block: the chained key differs.
    assert bm.get_computed_blocks([9, 9, 9, 9, 4, 5, 6, 7, 1]) == []
    bm.free("a")


def test_lru_eviction_takes_the_oldest_unreferenced_block():
    bm = make_block_manager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm.cache_full_blocks("a", [1, 2], 2)
    bm.allocate("b", 2)
    bm.cache_full_blocks("b", [3, 4], 2)
    a_block, b_block = bm.block_ids("a")[0], bm.block_ids("b")[0]
    bm.free("a")
    bm.free("b")
    bm.allocate("c", 6)  # 2 free blocks + 1 eviction: a's (freed first) goes
    assert bm.get_computed_blocks([1, 2, 0]) == []
    assert bm.get_computed_blocks([3, 4, 0]) == [b_block]
    assert a_block in bm.block_ids("c")
    bm.free("c")
    assert_no_leak(bm)


def test_taking_an_evictable_hit_counts_against_free_blocks():
    bm = make_block_manager(num_blocks=2, block_size=2)
    bm.allocate("a", 2)
    bm.cache_full_blocks("a", [1, 2], 2)
    bm.free("a")
    hits = bm.get_computed_blocks([1, 2, 3])
    assert bm.num_free_blocks == 2
    assert bm.can_allocate("b", 4, hits)
    assert not bm.can_allocate("b", 6, hits)
    bm.allocate("b", 4, hits)
    assert bm.num_free_blocks == 0
    bm.free("b")
    assert_no_leak(bm)


def test_swap_out_and_in_round_trip():
    bm = make_block_manager(num_blocks=4, block_size=2, num_host_blocks=4)
    table = list(bm.allocate("a", 5))
    assert bm.can_swap_out("a")
    pairs = bm.swap_out("a")
    assert [d for d, _ in pairs] == table and bm.num_used_blocks == 0
    assert bm.can_swap_in("a", 6)
    back = bm.swap_in("a", 6)
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert len(bm.block_ids("a")) == 3
    bm.free("a")
    assert_no_leak(bm)


def _hold(bm, tokens: dict[str, list[int]], rid: str, seq: list[int], hits=()) -> None:
    """Allocate and cache `seq` for `rid` when it fits (a first allocation with its prefix hits,
    or a grow)."""
    if bm.can_allocate(rid, len(seq), hits):
        bm.allocate(rid, len(seq), hits)
        bm.cache_full_blocks(rid, seq, len(seq))
        tokens[rid] = seq


def _alloc_free_or_swap(bm, tokens: dict[str, list[int]], op: str, rid: str, new_seq: list[int]) -> None:
    """The operations both properties below run: alloc (`new_seq`, with its prefix hits), free,
    swap out and back in; any other op is the caller's."""
    if op == "alloc" and rid not in tokens and rid not in bm.host_tables:
        _hold(bm, tokens, rid, new_seq, bm.get_computed_blocks(new_seq))
    elif op == "free":
        bm.free(rid)
        bm.free_host(rid)
        tokens.pop(rid, None)
    elif op == "swap" and rid in tokens and bm.can_swap_out(rid):
        seq = tokens.pop(rid)
        bm.swap_out(rid)
        if bm.can_swap_in(rid, len(seq)):
            bm.swap_in(rid, len(seq))
            tokens[rid] = seq


def _free_everything(bm, tokens: dict[str, list[int]]) -> None:
    for rid in list(tokens) + list(bm.host_tables):
        bm.free(rid)
        bm.free_host(rid)
    assert_no_leak(bm)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free", "swap"]), st.integers(0, 5),
                          st.integers(1, 12), st.integers(0, 2)), max_size=60))
def test_random_operations_keep_the_books_balanced(ops):
    """Property: any sequence of allocate / grow / cache / free / swap keeps free + cached + used
    == total and refcounts equal to table references; freeing everything leaves nothing in use."""
    bm = make_block_manager(num_blocks=12, block_size=2, num_host_blocks=6)
    tokens: dict[str, list[int]] = {}
    for op, who, n, alphabet in ops:
        rid = f"r{who}"
        if op == "grow" and rid in tokens:
            _hold(bm, tokens, rid, tokens[rid] + [n % 3] * (n % 4 + 1))
        else:  # small alphabet: prefixes collide
            _alloc_free_or_swap(bm, tokens, op, rid, [(i * (alphabet + 1)) % 3 for i in range(n)])
        bm.check_invariants()
    _free_everything(bm, tokens)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "spec", "free", "swap"]), st.integers(0, 5),
                          st.integers(1, 12), st.integers(0, 4)), max_size=60))
def test_speculative_grow_and_rollback_keep_the_books_balanced(ops):
    """Property, with speculative decoding's steps: a request grows by 1 + k slots (its last
    token and k drafts), keeps `accepted` of the drafts and trims the rest (`trim`); the books
    balance after every operation, a request never holds a block past its computed tokens after a
    trim, and freeing everything leaves nothing in use."""
    bm = make_block_manager(num_blocks=12, block_size=2, num_host_blocks=6)
    tokens: dict[str, list[int]] = {}
    for op, who, n, accepted in ops:
        rid = f"r{who}"
        if op == "spec" and rid in tokens:
            k = n % 5
            seq = tokens[rid]
            if bm.can_allocate(rid, len(seq) + 1 + k):
                bm.allocate(rid, len(seq) + 1 + k)
                seq = seq + [n % 3] * (1 + min(accepted, k))  # the fed token and the accepted drafts
                bm.cache_full_blocks(rid, seq, len(seq))
                bm.trim(rid, len(seq))
                assert len(bm.block_ids(rid)) == bm.num_blocks_for(len(seq))
                tokens[rid] = seq
        else:
            _alloc_free_or_swap(bm, tokens, op, rid, [(i * (who + 1)) % 3 for i in range(n)])
        bm.check_invariants()
    _free_everything(bm, tokens)
