import pytest

from pdserve.kvtransfer.lease import LeaseTable

from .conftest import FakeClock, ReleaseLog


def make_table(default_s: float = 30.0):
    log, clock = ReleaseLog(), FakeClock()
    return LeaseTable(log, default_s, clock), log, clock


def test_expiry_releases_exactly_once():
    table, log, clock = make_table()
    table.hold("a", 10.0)
    table.hold("b", 20.0)
    clock.advance(9.9)
    assert table.expire() == []
    clock.advance(0.2)
    assert table.expire() == ["a"]
    assert table.expire() == []
    assert not table.release("a")  # a KVDone after expiry does not release again
    assert table.held_ids == ["b"] and len(table) == 1
    clock.advance(10)
    assert table.expire() == ["b"]
    log.assert_released_once(["a", "b"])


def test_renewal_prevents_expiry():
    table, log, clock = make_table()
    table.hold("a", 10.0)
    for _ in range(5):
        clock.advance(8)
        assert table.renew("a")
        assert table.expire() == []
    assert "a" in table
    clock.advance(10)
    assert table.expire() == ["a"]
    assert not table.renew("a")
    log.assert_released_once(["a"])


def test_release_and_abort_once():
    table, log, _ = make_table()
    table.hold("a", 5.0)
    table.hold("b")  # default lease
    assert table.release("a") and not table.release("a")
    assert table.deadline("b") == pytest.approx(1000.0 + 30.0)
    assert table.release("b")
    assert not table.release("never-held")
    log.assert_released_once(["a", "b"])
    assert len(table) == 0


def test_hold_twice_is_an_error():
    table, log, _ = make_table()
    table.hold("a")
    with pytest.raises(ValueError):
        table.hold("a")
    table.release("a")
    log.assert_released_once(["a"])


def test_callback_error_does_not_double_release():
    calls = []

    def release(rid):
        calls.append(rid)
        raise RuntimeError("boom")

    table = LeaseTable(release, 30.0, FakeClock())
    table.hold("a")
    with pytest.raises(RuntimeError):
        table.release("a")
    assert not table.release("a") and calls == ["a"]
