import subprocess
from pathlib import Path

import pytest

from sluicegate import ids
from sluicegate.errors import ConfigError


def test_model_version_carries_commit_and_data() -> None:
    code = ids.CodeVersion(commit="3f2a1bc" + "0" * 33, dirty=False)
    version = ids.model_version((1, 2, 0), code, "9d0e4f1" + "a" * 57)
    assert str(version) == "v1.2.0-3f2a1bc-9d0e4f1"
    assert ids.ModelVersionId.parse(str(version)) == version


@pytest.mark.parametrize(
    "text", ["1.2.0-3f2a1bc-9d0e4f1", "v1.2-3f2a1bc-9d0e4f1", "v1.2.0-3F2A1BC-9d0e4f1", "v01.2.0-3f2a1bc-9d0e4f1"]
)
def test_malformed_model_versions_say_the_form(text: str) -> None:
    with pytest.raises(ConfigError, match=r"vMAJOR\.MINOR\.PATCH-<commit7>-<data7>"):
        ids.ModelVersionId.parse(text)


def test_data_version_is_the_manifest_sha256_and_object_digest_is_order_free() -> None:
    assert ids.data_version(b"path,label,split\n") == ids.sha256_bytes(b"path,label,split\n")
    a = {"x.png": {"version_id": "1", "etag": "e"}, "y.png": {"version_id": "2", "etag": "f"}}
    b = dict(reversed(list(a.items())))
    assert ids.object_versions_digest(a) == ids.object_versions_digest(b)
    assert ids.object_versions_digest(a) != ids.object_versions_digest({**a, "y.png": {"version_id": "3", "etag": "f"}})


def test_code_version_of_a_git_tree(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    clean = ids.code_version(tmp_path)
    assert len(clean.commit) == 40 and not clean.dirty
    (tmp_path / "a.txt").write_text("2")
    assert ids.code_version(tmp_path).dirty
    assert ids.code_version(tmp_path / "missing").commit == "unknown"
    assert ids.code_version(baked="f" * 40) == ids.CodeVersion("f" * 40, False)


def test_environment_names_the_ml_stack_without_importing_it() -> None:
    env = ids.environment()
    assert env["python"].count(".") == 2
    assert "torch" in env and "onnxruntime" in env
    assert env["torch_cuda"] is None or env["torch_cuda"].startswith("cu")
