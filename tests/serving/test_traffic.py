"""TrafficSplitter: weighted routing between loaded versions, pinning, validation, unloads, threads."""

from __future__ import annotations

import math
import threading
from collections import Counter

import pytest

from serving.errors import InvalidInput, ModelNotFound, ModelNotReady
from serving.traffic import MAX_ENTRIES, MAX_WEIGHT, TrafficSplitter


def test_weights_80_20_hold_over_2000_choices() -> None:
    splitter = TrafficSplitter(seed=7)
    assert splitter.set_weights("resnet", {"1": 80, "2": 20}, ["1", "2"]) == {"1": 80, "2": 20}
    n, p = 2000, 0.8
    counts = Counter(splitter.choose("resnet", ["1", "2"]) for _ in range(n))
    assert set(counts) == {"1", "2"}
    assert abs(counts["1"] - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_the_same_seed_gives_the_same_sequence() -> None:
    picks = []
    for _ in range(2):
        splitter = TrafficSplitter(seed=11)
        splitter.set_weights("m", {"1": 1, "2": 1, "3": 1}, ["1", "2", "3"])
        picks.append([splitter.choose("m", ["1", "2", "3"]) for _ in range(50)])
    assert picks[0] == picks[1]


def test_without_weights_the_newest_loaded_version_serves() -> None:
    splitter = TrafficSplitter(seed=1)
    assert splitter.weights("m") == {}
    assert {splitter.choose("m", ["3", "1", "7"]) for _ in range(20)} == {"7"}  # load order, not numeric order


def test_a_named_version_is_served_whatever_the_weights() -> None:
    splitter = TrafficSplitter(seed=1)
    splitter.set_weights("m", {"1": 100}, ["1", "2"])
    assert {splitter.route("m", "2", ["1", "2"]) for _ in range(50)} == {"2"}
    assert {splitter.route("m", "", ["1", "2"]) for _ in range(50)} == {"1"}


def test_versions_not_named_get_no_traffic() -> None:
    splitter = TrafficSplitter(seed=3)
    assert splitter.set_weights("m", {"2": 5}, ["1", "2", "3"]) == {"1": 0, "2": 5, "3": 0}
    assert {splitter.choose("m", ["1", "2", "3"]) for _ in range(50)} == {"2"}
    # A version loaded after the weights were set is not a candidate either, until weights name it.
    assert {splitter.choose("m", ["1", "2", "3", "4"]) for _ in range(50)} == {"2"}


def test_unloaded_weighted_versions_fall_back_to_the_newest() -> None:
    splitter = TrafficSplitter(seed=5)
    splitter.set_weights("m", {"1": 50, "2": 50}, ["1", "2", "3"])
    assert {splitter.choose("m", ["2", "3"]) for _ in range(50)} == {"2"}  # the share of "1" moves to "2"
    assert {splitter.choose("m", ["3", "4"]) for _ in range(50)} == {"4"}  # no weighted version loaded


@pytest.mark.parametrize(
    ("weights", "error", "message"),
    [
        ({"9": 1}, ModelNotFound, r"version '9' .* is not loaded; loaded versions: \['1', '2'\]"),
        ({"1": -1}, InvalidInput, r"weight of version '1' is -1; use a non-negative integer"),
        ({"1": 0.5}, InvalidInput, r"weight of version '1' is 0.5"),
        ({"1": True}, InvalidInput, r"weight of version '1' is True"),
        ({"1": 10**400}, InvalidInput, r"weight of version '1' is an integer of 1329 bits; .* up to 1000000"),
        ({"1": 10**5000}, InvalidInput, r"weight of version '1' is an integer of \d+ bits"),  # repr would raise
        ({"1": MAX_WEIGHT + 1}, InvalidInput, r"weight of version '1' is 1000001; use a non-negative integer up to"),
        ({"1": 2**32 - 1}, InvalidInput, r"is 4294967295"),  # the largest gRPC uint32
        ({"1": "5"}, InvalidInput, r"weight of version '1' is '5'"),
        ({"1": None}, InvalidInput, r"weight of version '1' is None"),
        ({1: 5}, InvalidInput, r"version 1 is not a string"),
        ({str(i): 1 for i in range(MAX_ENTRIES + 1)}, InvalidInput, rf"{MAX_ENTRIES + 1} traffic weights; .* at most"),
        ({"1": 0, "2": 0}, InvalidInput, r"sum to 0"),
        ({}, InvalidInput, r"sum to 0"),
    ],
)
def test_bad_weights_are_refused_and_named(weights: dict[str, object], error: type[Exception], message: str) -> None:
    splitter = TrafficSplitter(seed=1)
    splitter.set_weights("m", {"1": 1}, ["1", "2"])
    with pytest.raises(error, match=message):
        splitter.set_weights("m", weights, ["1", "2"])  # type: ignore[arg-type]
    assert splitter.weights("m") == {"1": 1, "2": 0}  # a refused update leaves the old weights


def test_forget_drops_a_version_and_then_the_model() -> None:
    splitter = TrafficSplitter(seed=2)
    splitter.set_weights("m", {"1": 30, "2": 70}, ["1", "2", "3"])
    splitter.forget("m", "2")
    assert splitter.weights("m") == {"1": 30, "3": 0}
    assert {splitter.choose("m", ["1", "3"]) for _ in range(50)} == {"1"}
    splitter.forget("m", "1")  # no positive weight left: back to the newest version
    assert splitter.weights("m") == {}
    assert splitter.choose("m", ["1", "3"]) == "3"
    splitter.forget("m", "1")  # forgetting again, or an unknown model, is harmless
    splitter.forget("other", "1")


def test_clear_returns_to_the_newest_version() -> None:
    splitter = TrafficSplitter(seed=2)
    splitter.set_weights("m", {"1": 1}, ["1", "2"])
    splitter.clear("m")
    assert splitter.weights("m") == {}
    assert splitter.choose("m", ["1", "2"]) == "2"


def test_models_are_independent() -> None:
    splitter = TrafficSplitter(seed=4)
    splitter.set_weights("a", {"1": 1}, ["1", "2"])
    assert splitter.choose("b", ["1", "2"]) == "2"
    assert splitter.choose("a", ["1", "2"]) == "1"


def test_no_loaded_version_is_not_ready() -> None:
    with pytest.raises(ModelNotReady, match="'m' has no loaded version"):
        TrafficSplitter().choose("m", [])


def test_concurrent_updates_and_choices_stay_consistent() -> None:
    splitter = TrafficSplitter(seed=6)
    loaded = ["1", "2", "3"]
    splitter.set_weights("m", {"1": 1}, loaded)
    seen: list[str] = []
    errors: list[BaseException] = []

    def chooser() -> None:
        try:
            seen.extend(splitter.choose("m", loaded) for _ in range(2000))
        except BaseException as exc:
            errors.append(exc)

    def updater() -> None:
        try:
            for i in range(500):
                splitter.set_weights("m", {"1": i % 3, "2": 1}, loaded)
                splitter.forget("m", "2")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=chooser) for _ in range(4)] + [threading.Thread(target=updater)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert len(seen) == 8000
    assert set(seen) <= set(loaded)


def test_the_largest_weights_are_accepted_and_route() -> None:
    splitter = TrafficSplitter(seed=2)
    assert splitter.set_weights("m", {"1": MAX_WEIGHT, "2": MAX_WEIGHT}, ["1", "2"]) == {
        "1": MAX_WEIGHT,
        "2": MAX_WEIGHT,
    }
    assert {splitter.choose("m", ["1", "2"]) for _ in range(100)} == {"1", "2"}


def test_a_refused_huge_weight_leaves_routing_working() -> None:
    """10**400 was accepted over HTTP, then every unversioned request failed with OverflowError."""
    splitter = TrafficSplitter(seed=2)
    with pytest.raises(InvalidInput):
        splitter.set_weights("m", {"1": 10**400, "2": 1}, ["1", "2"])
    assert splitter.weights("m") == {}
    assert splitter.route("m", "", ["1", "2"]) == "2"
