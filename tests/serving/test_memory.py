"""The trimmer's policy, fed the RSS sequences the hostile-input probes produce (pure: no threads, no clock)."""

from __future__ import annotations

from itertools import pairwise

from serving.memory import TrimPolicy

MiB = 1 << 20


def test_a_productive_trim_settles_and_keeps_the_floor() -> None:
    policy = TrimPolicy(growth_bytes=8 * MiB, tick_s=2.0)
    assert not policy.due(110 * MiB, 0.0)
    assert policy.due(150 * MiB, 2.0)
    policy.trimmed(112 * MiB, 2.0)
    assert policy.floor == 110 * MiB
    assert not policy.due(112 * MiB, 4.0)
    assert policy.due(150 * MiB, 6.0), "the next flood is trimmed again"


def test_a_trim_that_lands_mid_request_is_retried_at_the_next_tick() -> None:
    """CI's failure: the trim ran while a 40 MB probe was still being answered and gave nothing back; the
    first policy took the high RSS as its floor and never trimmed again once the request was freed."""
    policy = TrimPolicy(growth_bytes=8 * MiB, tick_s=2.0)
    policy.due(144 * MiB, 0.0)
    assert policy.due(175 * MiB, 2.0)
    policy.trimmed(175 * MiB, 2.0)  # still in use
    assert policy.floor == 144 * MiB, "an unproductive trim must not raise the floor"
    assert policy.due(175 * MiB, 4.0), "retried at the next tick once the request is freed"
    policy.trimmed(140 * MiB, 4.0)
    assert policy.floor == 140 * MiB
    assert not policy.due(141 * MiB, 6.0)


def test_unproductive_trims_back_off_and_a_lasting_rise_becomes_the_floor() -> None:
    policy = TrimPolicy(growth_bytes=8 * MiB, tick_s=2.0, eager_tries=3, accept_after_s=120.0)
    policy.due(100 * MiB, 0.0)
    trims = []
    now = 2.0
    while now < 130.0:
        if policy.due(300 * MiB, now):  # a model loaded later: the memory stays in use
            trims.append(now)
            policy.trimmed(300 * MiB, now)
        now += 2.0
    assert trims[:3] == [2.0, 4.0, 6.0], "every tick while eager"
    gaps = [later - earlier for earlier, later in pairwise(trims[2:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], f"back-off must grow: {gaps}"
    assert len(trims) < 10, f"a server that really grew pays few trims: {trims}"
    assert policy.floor == 300 * MiB, "after accept_after_s of high readings the new RSS is the working set"
    assert not policy.due(302 * MiB, now)


def test_a_busy_process_is_trimmed_at_most_once_per_busy_interval_and_at_once_when_quiet() -> None:
    """Under steady traffic the RSS swings by the requests in flight: trimming every tick gave pages back
    that the next requests faulted straight in again."""
    policy = TrimPolicy(growth_bytes=8 * MiB, tick_s=2.0, busy_cpu_share=0.25, busy_interval_s=30.0)
    policy.due(100 * MiB, 0.0)
    trims = []
    now = 2.0
    while now < 64.0:
        high = 100 * MiB + (40 * MiB if int(now) % 4 == 2 else 20 * MiB)  # requests in flight
        if policy.due(high, now, cpu_share=0.9):
            trims.append(now)
            policy.trimmed(105 * MiB, now)  # productive: what was in flight is freed at that moment
        now += 2.0
    assert trims == [2.0, 32.0, 62.0], trims
    # The traffic stops with memory left over: the first quiet tick trims it.
    assert not policy.due(140 * MiB, 64.0, cpu_share=0.9)
    assert policy.due(140 * MiB, 66.0, cpu_share=0.01)


def test_a_flood_while_a_lasting_rise_backs_off_is_trimmed_at_once() -> None:
    """A model load's growth puts the trimmer in back-off; a 40 MB probe in that window must not wait for
    it (a hostile-input test once found its flood still resident after 10 s)."""
    policy = TrimPolicy(growth_bytes=8 * MiB, tick_s=2.0, eager_tries=3, accept_after_s=120.0)
    policy.due(100 * MiB, 0.0)
    now, waiting = 2.0, []
    while now < 40.0:
        if policy.due(300 * MiB, now):
            policy.trimmed(300 * MiB, now)
        elif now > 8.0:
            waiting.append(now)
        now += 2.0
    assert waiting, "the lasting rise is backing off"
    assert policy.due(340 * MiB, now), "a flood on top of it is new memory: trimmed at the next tick"
    policy.trimmed(301 * MiB, now)  # the flood went back; the model stays
    assert not policy.due(301 * MiB, now + 2.0), "and the back-off for the model's memory goes on"
