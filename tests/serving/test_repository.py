"""The server's model repository on real sources: a directory, a moto S3 server and a real MLflow server,
with real exported ONNX models; damaged versions are rejected while the others load."""

from __future__ import annotations

import hashlib
import pickle
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import numpy as np
import pytest

from serving.errors import RepositoryError
from serving.repository import LocalVersion, ModelRepository, RejectedVersion
from serving.runtimes import load_runtime
from serving.runtimes.onnxruntime import OnnxRuntime
from tests.fixtures.models import resnet, write_model_version
from tests.fixtures.services import free_port

V1, V2 = "v1.0.0-aaaaaaa-1111111", "v1.0.1-bbbbbbb-2222222"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_model_version(root, "pcb", V1, resnet(1))
    write_model_version(root, "pcb", V2, resnet(2))
    write_model_version(root, "other", V1, resnet(3))
    shutil.rmtree(root / ".work")  # the export scratch folder, not part of the repository
    return root


def found(versions: list[LocalVersion]) -> list[tuple[str, str]]:
    return [(v.model, v.version) for v in versions]


def copy_of(repo: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(repo, tmp_path / "repo"))


def logits(path: Path, seed: int = 0) -> np.ndarray:
    batch = np.random.default_rng(seed).standard_normal((3, 3, 32, 32)).astype(np.float32)
    runtime = OnnxRuntime(path / "model.onnx")
    try:
        return runtime.infer({"input": batch})["logits"]
    finally:
        runtime.close()


# -- a local directory ----------------------------------------------------------------------------


def test_a_local_directory_lists_every_verified_version(repo: Path, tmp_path: Path) -> None:
    repository = ModelRepository(str(repo), cache_dir=tmp_path / "cache")
    assert repository.materialize() == repo
    versions = repository.versions()
    assert found(versions) == [("other", V1), ("pcb", V1), ("pcb", V2)]
    assert repository.rejected == []
    first = versions[1]
    assert first.path == repo / "pcb" / V1
    assert first.config.name == "pcb" and first.config.version == V1
    assert first.config.inputs[0]["shape"] == [-1, 3, 32, 32]


def test_a_missing_directory_names_the_source_and_the_fix(tmp_path: Path) -> None:
    repository = ModelRepository(str(tmp_path / "nowhere"), cache_dir=tmp_path / "cache")
    with pytest.raises(RepositoryError, match=r"nowhere' is not a directory: create it with <model>/<version>/"):
        repository.materialize()


def test_an_altered_file_is_rejected_and_the_other_versions_load(repo: Path, tmp_path: Path) -> None:
    root = copy_of(repo, tmp_path)
    model = root / "pcb" / V1 / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    repository = ModelRepository(str(root), cache_dir=tmp_path / "cache")
    assert found(repository.versions()) == [("other", V1), ("pcb", V2)]
    [rejected] = repository.rejected
    where, reason = rejected  # unpacks as (where, reason), the shape the data plane reports
    assert where == f"pcb/{V1}"
    assert "model.onnx was altered" in reason and "re-publish the version" in reason


def test_a_pickle_is_refused_even_when_its_sum_matches(repo: Path, tmp_path: Path) -> None:
    root = copy_of(repo, tmp_path)
    version = root / "pcb" / V2
    (version / "weights.bin").write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=4))
    digest = hashlib.sha256((version / "weights.bin").read_bytes()).hexdigest()
    with (version / "SHA256SUMS").open("a") as sums:
        sums.write(f"{digest}  weights.bin\n")
    repository = ModelRepository(str(root), cache_dir=tmp_path / "cache")
    assert found(repository.versions()) == [("other", V1), ("pcb", V1)]
    assert repository.rejected == [
        RejectedVersion(f"pcb/{V2}", repository.rejected[0].reason),
    ]
    assert "weights.bin is a pickle (protocol 4 header)" in repository.rejected[0].reason


def test_broken_folders_never_stop_the_scan(repo: Path, tmp_path: Path) -> None:
    root = copy_of(repo, tmp_path)
    (root / "pcb" / "v9-no-sums").mkdir()
    (root / "pcb" / "v9-no-sums" / "config.json").write_text("{}")
    (root / "pcb" / V1 / "config.json").write_text("not json")
    (root / "README.md").write_text("a file beside the models is not a model")
    (root / "pcb" / ".v3.partial").mkdir()  # an interrupted write_version: not a version
    repository = ModelRepository(str(root), cache_dir=tmp_path / "cache")
    assert found(repository.versions()) == [("other", V1), ("pcb", V2)]
    reasons = dict(repository.rejected)
    assert set(reasons) == {f"pcb/{V1}", "pcb/v9-no-sums"}
    assert "config.json was altered" in reasons[f"pcb/{V1}"]
    assert "has no SHA256SUMS" in reasons["pcb/v9-no-sums"]


# -- S3 (moto) ------------------------------------------------------------------------------------


@pytest.fixture
def s3_bucket(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # boto3's usual chain: the environment. moto accepts any credentials.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_url).create_bucket(Bucket=bucket)
    yield bucket


def upload(moto_url: str, bucket: str, prefix: str, root: Path) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=moto_url)
    keys = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(root).as_posix()}"
        s3.upload_file(str(path), bucket, key)
        keys.append(key)
    return keys


def test_an_s3_prefix_is_copied_keeping_the_layout_and_verified(
    repo: Path, tmp_path: Path, moto_url: str, s3_bucket: str
) -> None:
    upload(moto_url, s3_bucket, "serving/models", repo)
    cache = tmp_path / "cache"
    repository = ModelRepository(f"s3://{s3_bucket}/serving/models", cache_dir=cache, s3_endpoint_url=moto_url)
    assert repository.materialize() == cache
    versions = repository.versions()
    assert found(versions) == [("other", V1), ("pcb", V1), ("pcb", V2)]
    assert versions[1].path == cache / "pcb" / V1
    assert (cache / "pcb" / V1 / "model.onnx").read_bytes() == (repo / "pcb" / V1 / "model.onnx").read_bytes()
    np.testing.assert_array_equal(logits(versions[1].path), logits(repo / "pcb" / V1))

    # Unchanged objects are not fetched again; a version deleted from the bucket leaves the cache.
    stamp = (cache / "pcb" / V1 / "model.onnx").stat().st_ino
    s3 = boto3.client("s3", endpoint_url=moto_url)
    for item in s3.list_objects_v2(Bucket=s3_bucket, Prefix=f"serving/models/pcb/{V2}/")["Contents"]:
        s3.delete_object(Bucket=s3_bucket, Key=item["Key"])
    repository.materialize()
    assert found(repository.versions()) == [("other", V1), ("pcb", V1)]
    assert (cache / "pcb" / V1 / "model.onnx").stat().st_ino == stamp
    assert not (cache / "pcb" / V2).exists()


def test_an_altered_object_in_s3_is_rejected(repo: Path, tmp_path: Path, moto_url: str, s3_bucket: str) -> None:
    upload(moto_url, s3_bucket, "m", repo)
    s3 = boto3.client("s3", endpoint_url=moto_url)
    s3.put_object(Bucket=s3_bucket, Key=f"m/other/{V1}/model.onnx", Body=b"not the model that was published")
    repository = ModelRepository(f"s3://{s3_bucket}/m/", cache_dir=tmp_path / "cache", s3_endpoint_url=moto_url)
    assert found(repository.versions()) == [("pcb", V1), ("pcb", V2)]
    assert [r.where for r in repository.rejected] == [f"other/{V1}"]
    assert "model.onnx was altered" in repository.rejected[0].reason


def test_an_empty_s3_prefix_names_the_source_and_the_fix(tmp_path: Path, moto_url: str, s3_bucket: str) -> None:
    repository = ModelRepository(f"s3://{s3_bucket}/empty", cache_dir=tmp_path / "cache", s3_endpoint_url=moto_url)
    with pytest.raises(RepositoryError, match=rf"s3://{s3_bucket}/empty' holds no objects: upload <model>/<version>/"):
        repository.materialize()


def test_a_missing_bucket_names_the_source_and_the_fix(tmp_path: Path, moto_url: str, s3_bucket: str) -> None:
    repository = ModelRepository("s3://no-such-bucket/m", cache_dir=tmp_path / "cache", s3_endpoint_url=moto_url)
    with pytest.raises(RepositoryError, match=r"s3://no-such-bucket/m' could not be read from S3 .*check the bucket"):
        repository.materialize()


# -- MLflow registry (models:/) -------------------------------------------------------------------


def register(mlflow_url: str, name: str, folder: Path) -> str:
    """Log and register a version folder the way the pipeline does; returns the registry version."""
    from tasks import registry, tracking

    client = tracking.client(mlflow_url)
    run = client.create_run(tracking.experiment_id(client, "serving-tests"))
    return registry.register_version(
        mlflow_url, name, run.info.run_id, folder, {registry.TAG_MODEL_VERSION: folder.name}
    )


def set_alias(mlflow_url: str, name: str, alias: str, number: str) -> None:
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=mlflow_url, registry_uri=mlflow_url).set_registered_model_alias(name, alias, number)


@pytest.fixture(scope="module")
def registered(repo: Path, mlflow_url: str) -> tuple[str, str, str]:
    """A registered model with two versions, the second holding ``champion``."""
    name = f"pcb-{uuid.uuid4().hex[:6]}"
    first = register(mlflow_url, name, repo / "pcb" / V1)
    second = register(mlflow_url, name, repo / "pcb" / V2)
    set_alias(mlflow_url, name, "champion", second)
    return name, first, second


def test_an_alias_is_followed_downloaded_verified_and_loaded(
    repo: Path, tmp_path: Path, mlflow_url: str, registered: tuple[str, str, str]
) -> None:
    name, _, _ = registered
    cache = tmp_path / "cache"
    repository = ModelRepository(f"models:/{name}@champion", cache_dir=cache, mlflow_tracking_uri=mlflow_url)
    assert repository.materialize() == cache
    [version] = repository.versions()
    assert (version.model, version.version, version.path) == ("pcb", V2, cache / "pcb" / V2)
    assert repository.rejected == []
    assert sorted(p.name for p in version.path.iterdir()) == ["SHA256SUMS", "config.json", "model.onnx"]

    runtime = load_runtime(version.path, version.config, probe_interval_s=0)
    try:
        assert runtime.level_name == "onnxruntime"
        batch = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
        np.testing.assert_array_equal(runtime.infer({"input": batch})["logits"], logits(repo / "pcb" / V2))
    finally:
        runtime.close()

    # A cached copy that is whole is kept; a damaged one is fetched again.
    model = version.path / "model.onnx"
    inode = model.stat().st_ino
    repository.materialize()
    assert model.stat().st_ino == inode
    model.write_bytes(b"damaged on disk")
    repository.materialize()
    assert found(repository.versions()) == [("pcb", V2)]
    assert model.read_bytes() == (repo / "pcb" / V2 / "model.onnx").read_bytes()


def test_an_alias_move_serves_only_the_new_holder(
    tmp_path: Path, mlflow_url: str, registered: tuple[str, str, str]
) -> None:
    name, first, second = registered
    cache = tmp_path / "cache"
    repository = ModelRepository(f"models:/{name}@canary", cache_dir=cache, mlflow_tracking_uri=mlflow_url)
    set_alias(mlflow_url, name, "canary", second)
    repository.materialize()
    assert found(repository.versions()) == [("pcb", V2)]
    set_alias(mlflow_url, name, "canary", first)
    repository.materialize()
    # The old holder stays in the cache but is not served: the source names one version.
    assert found(repository.versions()) == [("pcb", V1)]


def test_a_registry_version_number_is_followed(
    tmp_path: Path, mlflow_url: str, registered: tuple[str, str, str]
) -> None:
    name, first, _ = registered
    repository = ModelRepository(f"models:/{name}/{first}", cache_dir=tmp_path / "c", mlflow_tracking_uri=mlflow_url)
    assert found(repository.versions()) == [("pcb", V1)]


def test_a_damaged_registered_version_is_rejected(repo: Path, tmp_path: Path, mlflow_url: str) -> None:
    name = f"bad-{uuid.uuid4().hex[:6]}"
    folder = Path(shutil.copytree(repo / "pcb" / V1, tmp_path / "src" / "pcb" / V1))
    (folder / "config.json").write_bytes((folder / "config.json").read_bytes() + b" ")
    set_alias(mlflow_url, name, "champion", register(mlflow_url, name, folder))
    repository = ModelRepository(f"models:/{name}@champion", cache_dir=tmp_path / "c", mlflow_tracking_uri=mlflow_url)
    assert repository.versions() == []
    assert [r.where for r in repository.rejected] == [f"pcb/{V1}"]
    assert "config.json was altered" in repository.rejected[0].reason


def test_an_unknown_alias_names_the_source_and_the_fix(
    tmp_path: Path, mlflow_url: str, registered: tuple[str, str, str]
) -> None:
    name, _, _ = registered
    source = f"models:/{name}@nobody"
    repository = ModelRepository(source, cache_dir=tmp_path / "c", mlflow_tracking_uri=mlflow_url)
    with pytest.raises(RepositoryError, match=rf"{source}: no version of '{name}' holds the alias 'nobody': set the"):
        repository.materialize()


def test_an_unknown_version_names_the_source_and_the_fix(
    tmp_path: Path, mlflow_url: str, registered: tuple[str, str, str]
) -> None:
    name, _, _ = registered
    repository = ModelRepository(f"models:/{name}/99", cache_dir=tmp_path / "c", mlflow_tracking_uri=mlflow_url)
    with pytest.raises(RepositoryError, match=rf"model '{name}' has no registry version 99: list the versions"):
        repository.materialize()


def test_an_unreachable_tracking_server_names_the_source_and_the_fix(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    repository = ModelRepository("models:/pcb@champion", cache_dir=tmp_path / "c", mlflow_tracking_uri=url)
    with pytest.raises(
        RepositoryError, match=rf"MLflow tracking server {url} is unreachable .*fix mlflow_tracking_uri"
    ):
        repository.materialize()


def test_a_models_source_without_a_tracking_server_says_which_setting(tmp_path: Path) -> None:
    repository = ModelRepository("models:/pcb@champion", cache_dir=tmp_path / "c")
    with pytest.raises(RepositoryError, match="needs an MLflow tracking server: set mlflow_tracking_uri"):
        repository.materialize()
