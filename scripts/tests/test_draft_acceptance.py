"""scripts/draft_acceptance.py's arithmetic of greedy speculation (the part that turns a draft
model's per-position agreement into accepted/drafted counts)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draft_acceptance import simulate  # noqa: E402


def test_every_position_agreeing_accepts_every_draft():
    # 9 ids: passes at 0, 3, 6 draft 2 each (the last pass drafts only what is left: 8 - 6 = 2).
    assert simulate([True] * 9, 2) == (6, 6)
    assert simulate([True] * 9, 1) == (4, 4)


def test_a_miss_ends_the_pass_and_the_next_starts_after_the_bonus_id():
    # K=2 at t=0: d1 agrees, d2 (t=1) misses -> 1 accepted, next pass at t=2.
    # t=2: misses at once -> 0, next at t=3; t=3: 2 accepted, next at t=6 (end: 7 ids).
    agree = [True, False, False, True, True, True, True]
    assert simulate(agree, 2) == (3, 6)
    # K=1: t=0 ok (next 2), t=2 miss (next 3), t=3 ok (next 5), t=5 ok (next 7).
    assert simulate(agree, 1) == (3, 4)


def test_alternating_agreement_accepts_one_of_two():
    # A draft right at every other position: at K=2 each pass takes one id of two (the last
    # pass, at t=22 of 24, has room for one draft only).
    assert simulate([True, False] * 12, 2) == (12, 23)
