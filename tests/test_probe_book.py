"""ProbeBook: queueing, in-flight probes, negative TTL and pruning, on an injected clock."""

from __future__ import annotations

import pytest

from kvtiers.core.keys import make_offload_key
from kvtiers.tiers.probe import DEFAULT_NEGATIVE_TTL_S, ProbeBook

KEYS = [make_offload_key(i.to_bytes(2, "big") * 8, 0) for i in range(16)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_miss_is_queued_once_and_not_while_in_flight() -> None:
    book = ProbeBook(clock=Clock())
    assert not book.known_absent(KEYS[0])
    assert not book.known_absent(KEYS[0])
    assert not book.known_absent(KEYS[1])
    assert book.take_batch() == [KEYS[0], KEYS[1]]
    assert book.probes == 2 and book.pending
    assert not book.known_absent(KEYS[0])  # in flight: RETRY, not queued again
    assert book.take_batch() == []
    assert book.answered([(KEYS[0], 10), (KEYS[1], None)]) == [(KEYS[0], 10)]
    assert not book.pending


def test_a_negative_answer_holds_for_the_ttl_only() -> None:
    clock = Clock()
    book = ProbeBook(negative_ttl_s=2.0, clock=clock)
    book.known_absent(KEYS[0])
    book.answered([(key, None) for key in book.take_batch()])
    clock.now += 1.999
    assert book.known_absent(KEYS[0])
    assert book.take_batch() == []
    clock.now += 0.001
    assert not book.known_absent(KEYS[0])
    assert book.take_batch() == [KEYS[0]]


def test_a_store_forgets_the_negative_answer() -> None:
    book = ProbeBook(clock=Clock())
    book.known_absent(KEYS[0])
    book.answered([(key, None) for key in book.take_batch()])
    book.stored(KEYS[0])
    assert not book.known_absent(KEYS[0])


def test_pruning_drops_expired_answers_beyond_prune_at() -> None:
    clock = Clock()
    book = ProbeBook(negative_ttl_s=1.0, prune_at=4, clock=clock)
    book.answered([(key, None) for key in KEYS[:4]])
    assert book.remembered == 4
    clock.now += 1.0
    book.answered([(KEYS[4], None)])  # 5 held, over prune_at: the 4 expired ones go
    assert book.remembered == 1
    assert book.known_absent(KEYS[4])
    book.answered([(key, None) for key in KEYS[5:9]])  # 5 held, none expired: all stay
    assert book.remembered == 5


def test_reset_drops_queued_probes_and_negative_answers() -> None:
    book = ProbeBook(clock=Clock())
    book.answered([(KEYS[0], None)])
    book.known_absent(KEYS[1])
    book.reset()
    assert not book.pending and book.remembered == 0
    assert not book.known_absent(KEYS[0])


def test_one_default_ttl_and_bad_arguments_are_refused() -> None:
    assert ProbeBook().negative_ttl_s == DEFAULT_NEGATIVE_TTL_S
    with pytest.raises(ValueError, match="negative_ttl_s must be >= 0"):
        ProbeBook(negative_ttl_s=-1.0)
    with pytest.raises(ValueError, match="prune_at must be >= 0"):
        ProbeBook(prune_at=-1)
