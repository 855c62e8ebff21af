"""serving/runtimes/engine_cache.py: engines are built at most once per key and reused after (hits and
misses reported), a failed build caches nothing, the key changes with everything an engine depends on;
on a host without TensorRT a version with only model.onnx serves from ONNX Runtime without trying. The
GPU test builds a real engine from ONNX in the server and hits the cache on the second load."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from serving.runtimes import LoadOptions, load_runtime
from serving.runtimes.engine_cache import EngineCache, batch_profile, engine_key
from tests.fixtures.models import SPEC, resnet
from tests.serving.test_runtimes import batch, expected, gpu_tensorrt_missing, version_with


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tasks.conversion import export_onnx

    path = tmp_path_factory.mktemp("export") / "model.onnx"
    export_onnx(resnet(1), np.zeros((1, 3, SPEC.height, SPEC.width), dtype=np.float32), path)
    return path


def test_a_miss_builds_once_and_later_lookups_hit(tmp_path: Path) -> None:
    lookups: list[bool] = []
    builds: list[str] = []

    def build() -> tuple[bytes | None, str]:
        builds.append("built")
        time.sleep(0.05)  # long enough for the other threads to arrive while it builds
        return b"engine-bytes", ""

    cache = EngineCache(tmp_path / "engines", on_lookup=lookups.append)
    results: list[tuple[Path | None, bool, str]] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("k1", build))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert builds == ["built"]  # the three others waited and hit
    assert sorted(hit for _, hit, _ in results) == [False, True, True, True]
    assert sorted(lookups) == [False, True, True, True]
    path = results[0][0]
    assert path is not None and path.read_bytes() == b"engine-bytes"
    assert [p.name for p in (tmp_path / "engines").iterdir()] == ["k1.plan"]  # no partial file left


def test_a_failed_build_caches_nothing(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    assert cache.get("k2", lambda: (None, "TensorRT could not parse model.onnx")) == (
        None,
        False,
        "TensorRT could not parse model.onnx",
    )
    assert not (tmp_path / "k2.plan").exists()
    path, hit, _ = cache.get("k2", lambda: (b"x", ""))
    assert path is not None and not hit


def test_the_key_follows_everything_an_engine_depends_on() -> None:
    base = ("a" * 64, "10.7.0", "NVIDIA H200", "fp16", (1, 4, 8))
    keys = {engine_key(*base)}
    for index, other in enumerate(("b" * 64, "10.8.0", "NVIDIA L4", "fp32", (1, 8, 16))):
        changed = list(base)
        changed[index] = other
        keys.add(engine_key(*changed))  # type: ignore[arg-type]
    assert len(keys) == 6 and engine_key(*base) == engine_key(*base)
    assert batch_profile(8) == (1, 4, 8) and batch_profile(1) == (1, 1, 1)


@pytest.mark.skipif(not gpu_tensorrt_missing(), reason="TensorRT is installed here: the CPU-host case does not apply")
def test_without_tensorrt_an_onnx_only_version_serves_on_onnxruntime(tmp_path: Path, onnx_file: Path) -> None:
    path, cfg = version_with(tmp_path, {"model.onnx": onnx_file})
    lookups: list[bool] = []
    options = LoadOptions(engine_cache=EngineCache(tmp_path / "engines"), on_engine_lookup=lookups.append)
    runtime = load_runtime(path, cfg, probe_interval_s=0, options=options)
    try:
        assert runtime.level_name == "onnxruntime" and runtime.level_index == 0  # TensorRT was not a level
        np.testing.assert_allclose(runtime.infer(batch(2))["logits"], expected(onnx_file, batch(2)), atol=1e-5)
    finally:
        runtime.close()
    assert lookups == [] and not (tmp_path / "engines").exists()


@pytest.mark.gpu
@pytest.mark.skipif(bool(gpu_tensorrt_missing()), reason=gpu_tensorrt_missing() or "runs")
def test_the_server_builds_an_engine_from_onnx_and_hits_the_cache_next_time(tmp_path: Path, onnx_file: Path) -> None:
    path, cfg = version_with(tmp_path, {"model.onnx": onnx_file})
    lookups: list[bool] = []
    options = LoadOptions(engine_cache=EngineCache(tmp_path / "engines"), fp16=False, on_engine_lookup=lookups.append)
    for attempt in range(2):
        runtime = load_runtime(path, cfg, probe_interval_s=0, options=options)
        try:
            assert runtime.level_name == "tensorrt", attempt
            inputs = batch(3, seed=attempt)
            np.testing.assert_allclose(runtime.infer(inputs)["logits"], expected(onnx_file, inputs), atol=1e-3)
        finally:
            runtime.close()
    assert lookups == [False, True]
    # A model.plan this host cannot deserialize is replaced by the cached engine, not a fall to ORT.
    (path / "model.plan").write_bytes(b"built for another GPU")
    runtime = load_runtime(path, cfg, probe_interval_s=0, options=options)
    try:
        assert runtime.level_name == "tensorrt"
    finally:
        runtime.close()
    assert lookups == [False, True, True]
