import pytest
import torch

from pdserve.kvtransfer import payload
from pdserve.kvtransfer.payload import (
    copy_tokens,
    frame_to_tensor,
    gather_tokens,
    scatter_tokens,
    tensor_to_frame,
)

from .conftest import TEST_DTYPES, make_layout, make_pool, reference_tokens, same_bytes

BLOCK_SIZE_PAIRS = [(16, 16), (16, 8), (8, 32), (4, 16)]
NUM_TOKENS = 37  # not a multiple of any block size


def _blocks(num_tokens: int, block_size: int, num_blocks: int, seed: int) -> list[int]:
    """Non-contiguous, shuffled block ids."""
    need = -(-num_tokens // block_size)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return perm[:need]


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("src_bs,dst_bs", BLOCK_SIZE_PAIRS)
def test_gather_scatter_round_trip(dtype, src_bs, dst_bs):
    src = make_pool(make_layout(block_size=src_bs, num_blocks=16, dtype=dtype))
    dst = make_pool(make_layout(block_size=dst_bs, num_blocks=16, dtype=dtype), seed=None)
    src_ids, dst_ids = _blocks(NUM_TOKENS, src_bs, 16, 1), _blocks(NUM_TOKENS, dst_bs, 16, 2)

    payload = gather_tokens(src, src_ids, NUM_TOKENS)
    assert payload.is_contiguous() and payload.shape == (2, 2, NUM_TOKENS, 2, 16)
    assert same_bytes(payload, reference_tokens(src, src_ids, NUM_TOKENS))

    scatter_tokens(dst, dst_ids, payload)
    assert same_bytes(gather_tokens(dst, dst_ids, NUM_TOKENS), payload)
    untouched = [b for b in range(16) if b not in dst_ids]
    assert not dst[:, :, untouched].any(), "scatter wrote outside the request's blocks"


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("src_bs,dst_bs", BLOCK_SIZE_PAIRS)
def test_copy_tokens_matches_gather(dtype, src_bs, dst_bs):
    src = make_pool(make_layout(block_size=src_bs, num_blocks=16, dtype=dtype))
    dst = make_pool(make_layout(block_size=dst_bs, num_blocks=16, dtype=dtype), seed=None)
    src_ids, dst_ids = _blocks(NUM_TOKENS, src_bs, 16, 3), _blocks(NUM_TOKENS, dst_bs, 16, 4)
    copy_tokens(src, src_ids, dst, dst_ids, NUM_TOKENS)
    assert same_bytes(gather_tokens(dst, dst_ids, NUM_TOKENS), gather_tokens(src, src_ids, NUM_TOKENS))
    # only the request's tokens: the tail of the last block stays zero
    last, used = dst_ids[-1], NUM_TOKENS % dst_bs or dst_bs
    assert not dst[:, :, last, used:].any()


def test_pool_checks():
    pool = make_pool(make_layout(block_size=8, num_blocks=4))
    with pytest.raises(ValueError, match="cannot hold"):
        gather_tokens(pool, [0], 9)
    with pytest.raises(ValueError, match="out of range"):
        gather_tokens(pool, [4], 3)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_tokens(pool, [0], torch.zeros(3, 2, 4, 2, 16))
    with pytest.raises(ValueError, match="dtype"):
        scatter_tokens(pool, [0], torch.zeros(2, 2, 4, 2, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_frame_round_trip(dtype):
    t = make_pool(make_layout(dtype=dtype, num_blocks=2))[:, :, 0]  # non-contiguous slice is fine
    frame = tensor_to_frame(t)
    back = frame_to_tensor(bytes(frame), dtype, list(t.shape))
    assert same_bytes(back, t)


def test_frame_is_zero_copy():
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    frame = tensor_to_frame(t)
    t[0, 0] = 1.0
    assert frame_to_tensor(frame, "bfloat16", [4, 8])[0, 0].item() == 1.0


def test_frame_to_tensor_rejects_mismatch():
    with pytest.raises(ValueError, match="bytes"):
        frame_to_tensor(b"\x00" * 10, "float32", [3])
    with pytest.raises(ValueError, match="dtype"):
        frame_to_tensor(b"\x00" * 8, "int8", [8])
    with pytest.raises(ValueError, match="shape"):
        frame_to_tensor(b"\x00" * 8, "float32", [-2])


@pytest.mark.parametrize("chunk", [1024, 5])
@pytest.mark.parametrize("contiguous", [True, False])
def test_copy_tokens_paths(monkeypatch, chunk, contiguous):
    """Few runs: direct strided copies; many runs: staged in chunks. Same bytes either way."""
    monkeypatch.setattr(payload, "COPY_CHUNK_TOKENS", chunk)
    src = make_pool(make_layout(block_size=4, num_blocks=16, dtype="bfloat16"))
    dst = make_pool(make_layout(block_size=8, num_blocks=16, dtype="bfloat16"), seed=None)
    src_ids = list(range(3, 13)) if contiguous else list(range(12, 2, -1))
    dst_ids = [6, 7, 8, 9, 10]
    copy_tokens(src, src_ids, dst, dst_ids, 38)
    assert same_bytes(gather_tokens(dst, dst_ids, 38), reference_tokens(src, src_ids, 38))
    assert not dst[:, :, :6].any() and not dst[:, :, 11:].any()
