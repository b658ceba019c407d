"""Every wire message round-trips through msgpack; anything malformed is refused with
MessageError (never another exception), before or after parsing. Valid messages take the fast
decoder (msgspec); whatever it refuses, the slow one judges, and both agree."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol import messages as m

RANK = m.KVRank(head_start=1, head_end=2, shm_name="pdserve-x", probe_token="ab12")
LAYOUT = m.KVLayout(model="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16,
                    num_blocks=64, tp_size=2, ranks=[m.KVRank(0, 1, device_uuid="GPU-1", cuda_ipc={"size": 4}), RANK])
TOKEN = m.Token(request_id="r1", index=3, token_id=42, logprobs={42: -0.1, 7: -2.5}, finish_reason=None)
EXAMPLES = [
    m.Register(node_id="p0", role="prefill", model="tiny", kv_addr="", metrics_url="http://127.0.0.1:1",
               num_total_blocks=64, block_size=16, max_model_len=1024, host_id="h", pid=7),
    m.Heartbeat(node_id="d0", num_free_blocks=10, num_total_blocks=64, num_running=2, num_waiting=1,
                num_outstanding_tokens=300, ready=True, request_ids=["a", "b"], role="decode",
                step_samples=[[128.0, 2.0, 300.0, 0.02], [0.0, 3.0, 420.0, 0.01]]),
    m.Deregister(node_id="p0"),
    m.Reregister(reason="unknown node"),
    m.SetRole(role="decode", reason="planner: best 0P+2D"),
    m.KVEvents(node_id="d0", seq=7, prev_seq=3, tier="disk", stored=[hash((0, (1, 2))), -5], removed=[2**63 - 1],
               sent_at=1.5),
    m.KVEvents(node_id="p0", seq=9, prev_seq=0, stored=[1, 2, 3], reset=True),
    m.KVResync(reason="a gap"),
    m.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 5, "stop": ["x"]},
                     decode_node_id="d0", decode_kv_addr="tcp://127.0.0.1:5", priority=1, arrival_time=1.5),
    m.FirstToken(request_id="r1", token_id=9, logprobs={9: -0.5}, finish_reason="length", num_prompt_tokens=3,
                 num_cached_tokens=0, queued_s=0.1, prefill_s=0.2),
    m.TokenBatch.from_tokens("d0", [TOKEN, dataclasses.replace(TOKEN, index=4, logprobs=None, finish_reason="stop")]),
    m.Abort(request_id="r1", reason="client gone"),
    m.Error(request_id="r1", node_id="d0", message="boom", retryable=True),
    RANK,
    LAYOUT,
    m.Handshake(node_id="p0", layout=LAYOUT),
    m.HandshakeAck(node_id="d0", ok=False, error="dtype differs", same_host=False),
    m.KVReady(request_id="r1", prompt_token_ids=[1, 2, 3], first_token=9, first_logprobs=None,
              sampling={"max_tokens": 5}, num_tokens=3, block_ids=[4], block_size=16, lease_s=30.0, priority=0),
    m.KVPull(request_id="r1", head_ranges=[[0, 1], [1, 2]]),
    m.KVPull(request_id="r1", first_block=3),
    m.KVData(request_id="r1", ok=True, dtype="bfloat16", shapes=[[2, 2, 3, 1, 16], [2, 2, 3, 1, 16]]),
    m.LeaseRenew(request_id="r1"),
    m.KVDone(request_id="r1", ok=True),
]


def test_heartbeat_step_samples_are_bounded_rows_of_four():
    for bad in ([[1.0, 2.0]], [[0.0, 1.0, 1.0, 0.1]] * (m.MAX_STEP_SAMPLES + 1)):
        wire = m.Heartbeat("d0", 1, 1, 0, 0, step_samples=bad).encode()
        with pytest.raises(m.MessageError, match="step_samples"):
            m.decode(wire)


def test_kv_events_and_pulls_are_bounded():
    for bad, match in ((m.KVEvents("d0", 1, 0, tier="ssd"), "tier"),
                       (m.KVEvents("d0", 1, 0, stored=list(range(m.MAX_KV_EVENTS // 2 + 1)),
                                   removed=list(range(m.MAX_KV_EVENTS // 2))), "block keys"),
                       (m.KVPull("r1", first_block=-1), "first_block")):
        with pytest.raises(m.MessageError, match=match):
            m.decode(bad.encode())


def test_every_message_type_has_an_example():
    assert {type(e).TYPE for e in EXAMPLES} == set(m.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda e: type(e).TYPE)
def test_round_trip(msg):
    assert m.decode(msg.encode()) == msg


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("request_id"), "missing field"),
    (lambda d: d.update(version=99), "protocol version"),
    (lambda d: d.update(type="nope"), "unknown message type"),
    (lambda d: d.update(first_token="nine"), "expected int"),
    (lambda d: d.update(block_ids=[1, "x"]), "expected int"),
    (lambda d: d.update(block_ids=5), "expected a list"),
    (lambda d: d.update(extra=1), "unknown field"),
    (lambda d: d.update(lease_s=True), "expected float"),
])
def test_malformed_fields_are_refused(mutate, match):
    kv_ready = next(e for e in EXAMPLES if isinstance(e, m.KVReady))
    wire = msgpack.unpackb(kv_ready.encode(), strict_map_key=False)
    mutate(wire)
    with pytest.raises(m.MessageError, match=match):
        m.decode(msgpack.packb(wire))


def test_oversized_messages_are_refused_before_parsing():
    with pytest.raises(m.MessageError, match="exceeds"):
        m.decode(b"\x00" * (m.MAX_MESSAGE_BYTES + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_garbage_never_raises_anything_but_message_error(data):
    try:
        m.decode(data)
    except m.MessageError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "version", "request_id", "request_ids", "indexes", "token_ids",
                                        "finish_reasons", "logprobs", "node_id", "layout"]),
                       st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.lists(st.integers(-(2**31), 2**31), max_size=3),
                                 st.sampled_from(list(m.MESSAGE_TYPES)), st.just(1)), max_size=6))
def test_structured_garbage_never_raises_anything_but_message_error(obj):
    try:
        m.decode(msgpack.packb(obj))
    except m.MessageError:
        pass


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda e: type(e).TYPE)
def test_valid_messages_take_the_fast_path(msg, monkeypatch):
    def slow(data):
        raise AssertionError("the slow decoder ran on a valid message")

    monkeypatch.setattr(m, "_decode_slow", slow)
    assert m.decode(msg.encode()) == msg


def test_token_batch_columns_round_trip_to_tokens():
    tokens = [m.Token("a", 1, 5), m.Token("b", 7, 6, None, "length")]
    batch = m.TokenBatch.from_tokens("d0", tokens)
    assert batch.logprobs == []  # no token carries logprobs: no column
    assert m.decode(batch.encode()).tokens() == tokens
    with_lp = m.TokenBatch.from_tokens("d0", [*tokens, m.Token("c", 0, 9, {9: -0.5, 3: -1.0})])
    assert m.decode(with_lp.encode()).tokens()[2].logprobs == {9: -0.5, 3: -1.0}


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(indexes=[1]), "different lengths"),
    (lambda d: d.update(logprobs=[None]), "logprobs column"),
    (lambda d: d.update(token_ids=[1, True]), "expected int"),
    (lambda d: d.update(finish_reasons=[None, 3]), "expected str"),
    (lambda d: d.update(request_ids=[b"a", "b"]), "expected str"),
    (lambda d: d.update(logprobs=[None, [1]]), "expected dict"),
    (lambda d: d.pop("indexes"), "missing field"),
])
def test_malformed_token_batches_are_refused(mutate, match):
    batch = m.TokenBatch.from_tokens("d0", [m.Token("a", 1, 5), m.Token("b", 2, 6)])
    wire = msgpack.unpackb(batch.encode(), strict_map_key=False)
    mutate(wire)
    with pytest.raises(m.MessageError, match=match):
        m.decode(msgpack.packb(wire, use_bin_type=True))


def test_a_nested_message_of_the_wrong_type_is_refused():
    wire = msgpack.unpackb(m.Handshake(node_id="p0", layout=LAYOUT).encode(), strict_map_key=False)
    wire["layout"] = msgpack.unpackb(m.KVPull(request_id="r1").encode())
    with pytest.raises(m.MessageError, match="expected kv_layout"):
        m.decode(msgpack.packb(wire))
    wire["layout"] = {**msgpack.unpackb(LAYOUT.encode()), "version": 99}
    with pytest.raises(m.MessageError, match="protocol version"):
        m.decode(msgpack.packb(wire))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "version", "node_id", "request_ids", "indexes", "token_ids",
                                        "finish_reasons", "logprobs"]),
                       st.one_of(st.just("token_batch"), st.just(m.PROTOCOL_VERSION), st.text(max_size=3),
                                 st.lists(st.one_of(st.none(), st.integers(-5, 5), st.booleans(), st.text(max_size=2),
                                                    st.dictionaries(st.integers(0, 3), st.floats(allow_nan=False), max_size=2)),
                                          max_size=3)),
                       max_size=8))
def test_the_fast_decoder_accepts_nothing_the_slow_one_refuses(obj):
    data = msgpack.packb({"type": "token_batch", "version": m.PROTOCOL_VERSION, **obj})
    try:
        fast = m.decode(data)
    except m.MessageError:
        return
    assert m._decode_slow(data) == fast


def test_a_list_past_the_element_limit_is_refused(monkeypatch):
    monkeypatch.setattr(m, "MAX_TOKENS_PER_MESSAGE", 1000)  # the fast decoder has no such limit itself
    batch = m.TokenBatch.from_tokens("d0", [m.Token(f"r{i}", 1, 5) for i in range(1200)])
    with pytest.raises(m.MessageError, match="not msgpack"):
        m.decode(batch.encode())


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["ranks"][0].update(head_start="x"), "expected int"),
    (lambda d: d["ranks"][1].update(version=99), "protocol version"),
    (lambda d: d["ranks"][0].update(extra=1), "unknown field"),
    (lambda d: d["ranks"].append(msgpack.unpackb(m.KVPull(request_id="r1").encode())), "expected kv_rank"),
    (lambda d: d.update(ranks=5), "expected a list"),
    (lambda d: d.update(ranks=[5]), "a message must be a map"),
])
def test_malformed_rank_layouts_are_refused(mutate, match):
    """A layout's ranks are nested messages in a list: each is checked like any message."""
    wire = msgpack.unpackb(LAYOUT.encode(), strict_map_key=False)
    mutate(wire)
    with pytest.raises(m.MessageError, match=match):
        m.decode(msgpack.packb(wire, use_bin_type=True))
    handshake = msgpack.unpackb(m.Handshake(node_id="p0", layout=LAYOUT).encode(), strict_map_key=False)
    with pytest.raises(m.MessageError, match=match):  # nested one level deeper, in a Handshake
        m.decode(msgpack.packb({**handshake, "layout": wire}, use_bin_type=True))


@pytest.mark.parametrize("ranges", [[[0, 1, 2]], [[1]], [[]]])
def test_a_head_range_is_a_pair(ranges):
    wire = msgpack.unpackb(m.KVPull(request_id="r1").encode(), strict_map_key=False)
    wire["head_ranges"] = ranges
    with pytest.raises(m.MessageError, match="a head range is"):
        m.decode(msgpack.packb(wire))
