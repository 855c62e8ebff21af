from tasks.retrain import NewestDataset, decide

NEWEST = NewestDataset("datasets/pcb/2026-11-02/manifest.csv", "v2", "ab" * 32)


def test_no_dataset_is_nothing_to_do() -> None:
    decision = decide(None, None)
    assert not decision.retrain and "no dataset manifest" in decision.reason


def test_first_model_and_new_data_retrain() -> None:
    assert decide(NEWEST, None).retrain
    other = decide(NEWEST, ("v1.0.0-1234567-cdcdcdc", "cd" * 32))
    assert other.retrain and "other data" in other.reason and NEWEST.data7 in other.reason


def test_the_champions_own_data_is_skipped_unless_forced() -> None:
    champion = ("v1.0.0-1234567-ababab", "ab" * 32)
    skipped = decide(NEWEST, champion)
    assert not skipped.retrain and "already produced the champion v1.0.0-1234567-ababab" in skipped.reason
    assert "force" in skipped.reason and skipped.newest == NEWEST
    assert decide(NEWEST, champion, force=True).retrain
