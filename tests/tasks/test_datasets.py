import pytest

from sluicegate import ids, storage
from sluicegate.errors import DatasetError
from sluicegate.settings import Settings
from tasks import datasets
from tests.fixtures.platform import manifest_for, png, upload_dataset


def test_resolution_pins_every_object_version(platform: Settings) -> None:
    key = upload_dataset(platform, "pcb", "2026-11-29", count=5)
    s3 = storage.s3_client(platform)
    resolved, manifest = datasets.resolve_dataset_version(s3, platform.storage.bucket, key)
    assert resolved.name == "pcb" and resolved.label == "2026-11-29"
    assert resolved.data_version == ids.sha256_bytes(manifest)
    assert len(resolved.objects) == 5
    assert all(meta["version_id"] and meta["etag"] and meta["size"] > 0 for meta in resolved.objects.values())

    # Overwriting an image keeps the data version (same manifest) but changes the pinned objects.
    s3.put_object(Bucket=platform.storage.bucket, Key=resolved.prefix + "images/0000.png", Body=png(999))
    again, _ = datasets.resolve_dataset_version(s3, platform.storage.bucket, key)
    assert again.data_version == resolved.data_version
    assert again.objects_digest != resolved.objects_digest

    # The manifest's version id pins the bytes that were announced, even after an overwrite.
    first_version = resolved.manifest_version_id
    assert first_version
    s3.put_object(Bucket=platform.storage.bucket, Key=key, Body=manifest_for(["images/0000.png"]))
    pinned, _ = datasets.resolve_dataset_version(s3, platform.storage.bucket, key, first_version)
    assert pinned.data_version == resolved.data_version


def test_missing_objects_are_named(platform: Settings) -> None:
    s3 = storage.s3_client(platform)
    key = "datasets/pcb/broken/manifest.csv"
    s3.put_object(Bucket=platform.storage.bucket, Key=key, Body=manifest_for(["images/a.png", "images/b.png"]))
    with pytest.raises(DatasetError, match=r"lists 2 object\(s\) that do not exist: images/a.png, images/b.png"):
        datasets.resolve_dataset_version(s3, platform.storage.bucket, key)


def test_missing_manifest_version(platform: Settings) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        datasets.resolve_dataset_version(
            storage.s3_client(platform), platform.storage.bucket, "datasets/pcb/none/manifest.csv"
        )


def test_newest_manifest(platform: Settings) -> None:
    s3 = storage.s3_client(platform)
    assert datasets.newest_manifest(s3, platform.storage.bucket) is None
    upload_dataset(platform, "pcb", "a", count=1)
    newest = upload_dataset(platform, "pcb", "b", count=1)
    found = datasets.newest_manifest(s3, platform.storage.bucket)
    assert found is not None and found[0] == newest and found[1]


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("datasets/pcb/manifest.csv", "expected 'datasets/<name>/<version>/manifest.csv'"),
        ("other/pcb/v1/manifest.csv", "is not a dataset manifest"),
        ("datasets/pcb/v1/images.csv", "is not a dataset manifest"),
    ],
)
def test_dataset_key_layout(key: str, match: str) -> None:
    with pytest.raises(DatasetError, match=match):
        datasets.parse_dataset_key(key)


@pytest.mark.parametrize(
    ("manifest", "match"),
    [
        (b"path,label\nimages/a.png,good\n", "lacks column"),
        (b"path,label,split\n,good,train\n", "line 2: column 'path' is empty"),
        (b"path,label,split\n../x.png,good,train\n", "must be relative"),
        (b"path,label,split\n/abs.png,good,train\n", "must be relative"),
        (b"\xff\xfe\x00", "not UTF-8"),
    ],
)
def test_manifest_errors_name_the_problem(manifest: bytes, match: str) -> None:
    with pytest.raises(DatasetError, match=match):
        datasets.manifest_paths(manifest)
