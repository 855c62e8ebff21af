"""The runtimes and the fallback chain on real exported models: ONNX Runtime, the rule engine, TensorRT
where a GPU and TensorRT are present, and level changes when models break and heal."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serving.errors import InvalidInput, ModelNotReady, RuntimeFailure
from serving.model_format import ModelConfig, write_version
from serving.runtimes import load_runtime, probe_batch
from serving.runtimes.base import Array, Runtime
from serving.runtimes.fallback import FallbackRuntime
from serving.runtimes.onnxruntime import OnnxRuntime
from serving.runtimes.rules import RulesRuntime
from serving.runtimes.tensorrt import TensorRTRuntime
from tests.fixtures.models import LABELS, SPEC, resnet

CLASSES = len(LABELS)
RULES = {"format": 1, "output": "logits", "classes": CLASSES, "answer": 2, "reason": "no model runs: manual review"}


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tasks.conversion import export_onnx

    path = tmp_path_factory.mktemp("export") / "model.onnx"
    export_onnx(resnet(1), np.zeros((1, 3, SPEC.height, SPEC.width), dtype=np.float32), path)
    return path


def config(version: str = "v1") -> ModelConfig:
    return ModelConfig(
        name="pcb",
        version=version,
        platform="onnxruntime",
        inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, 3, SPEC.height, SPEC.width]}],
        outputs=[{"name": "logits", "datatype": "FP32", "shape": [-1, CLASSES]}],
        labels=list(LABELS),
        preprocessing=SPEC.to_dict(),
    )


def batch(rows: int = 3, seed: int = 0) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((rows, 3, SPEC.height, SPEC.width)).astype(np.float32)}


def expected(onnx_file: Path, inputs: Mapping[str, Array]) -> Array:
    runtime = OnnxRuntime(onnx_file)
    try:
        return runtime.infer(inputs)["logits"]
    finally:
        runtime.close()


def rules_file(folder: Path, **changes: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rules.json"
    path.write_text(json.dumps({**RULES, **changes}))
    return path


def one_hot(rows: int, answer: int = 2) -> Array:
    out = np.zeros((rows, CLASSES), dtype=np.float32)
    out[:, answer] = 1.0
    return out


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


class Breakable:
    """A real runtime that fails while ``broken`` is set (a GPU that errors, a wedged session): a fake that
    implements the interface, and notices being used after it was closed."""

    def __init__(self, inner: Runtime, broken: threading.Event, misuse: list[str]) -> None:
        self.inner, self.broken, self.misuse = inner, broken, misuse
        self.name, self.providers = inner.name, inner.providers
        self.closed = False

    def infer(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        if self.closed:
            self.misuse.append("infer after close")
        if self.broken.is_set():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.inner.infer(inputs)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


# -- the rule engine ------------------------------------------------------------------------------


def test_rules_answer_every_row_with_the_configured_class_and_are_flagged(tmp_path: Path) -> None:
    runtime = RulesRuntime(rules_file(tmp_path), outputs=config().outputs)
    out = runtime.infer(batch(5))
    assert list(out) == ["logits"]
    np.testing.assert_array_equal(out["logits"], one_hot(5))
    assert out["logits"].dtype == np.float32
    assert runtime.abnormal is True and runtime.name == "rules" and runtime.reason == RULES["reason"]
    with pytest.raises(InvalidInput, match="at least one input tensor"):
        runtime.infer({})
    with pytest.raises(InvalidInput, match="share one batch"):
        runtime.infer({"a": np.zeros((2, 1)), "b": np.zeros((3, 1))})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"answer": 4}, r"'answer' 4 is not a class index in \[0, 4\)"),
        ({"answer": "missing"}, r"'answer' is 'missing'; it must be a int"),
        ({"classes": True}, r"'classes' is True; it must be a int"),
        ({"classes": 0}, r"'classes' is 0: it must be at least 1"),
        ({"output": "scores"}, r"'output' 'scores' is not among config.json's outputs \['logits'\]"),
        ({"classes": 3, "answer": 0}, r"'classes' 3 does not match 'logits''s last dimension 4"),
        ({"format": 2}, r"'format' 2 is not 1"),
        ({"verdict": "x"}, r"unknown keys \['verdict'\]"),
        ({"reason": " "}, r"'output' and 'reason' must not be empty"),
    ],
)
def test_a_bad_rules_file_names_the_field(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeFailure, match=message):
        RulesRuntime(rules_file(tmp_path, **changes), outputs=config().outputs)


def test_a_rules_file_that_is_not_json_says_so(tmp_path: Path) -> None:
    (tmp_path / "rules.json").write_text("{output: logits")
    with pytest.raises(RuntimeFailure, match=r"rules\.json is not valid JSON"):
        RulesRuntime(tmp_path / "rules.json")


# -- load_runtime: the chain of a version ---------------------------------------------------------


def version_with(tmp_path: Path, files: dict[str, Path | bytes]) -> tuple[Path, ModelConfig]:
    """A verified version folder holding ``files`` (bytes are written to a scratch file first)."""
    sources: dict[str, Path] = {}
    for name, content in files.items():
        if isinstance(content, bytes):
            scratch = tmp_path / "scratch" / name
            scratch.parent.mkdir(parents=True, exist_ok=True)
            scratch.write_bytes(content)
            content = scratch
        sources[name] = content
    cfg = config()
    return write_version(tmp_path / "repo", cfg, sources), cfg


def test_a_corrupt_onnx_model_falls_to_the_rules_which_still_answer_flagged(tmp_path: Path) -> None:
    rules = rules_file(tmp_path / "src")
    path, cfg = version_with(tmp_path, {"model.onnx": b"\x08\x07 not a protobuf model", "rules.json": rules})
    changes: list[tuple[str, int, str]] = []
    runtime = load_runtime(path, cfg, probe_interval_s=0, on_change=lambda *c: changes.append(c))
    try:
        assert (runtime.level_name, runtime.level_index, runtime.name) == ("rules", 1, "rules")
        [reason] = runtime.failures
        assert reason.startswith("onnxruntime: ") and "model.onnx" in reason
        np.testing.assert_array_equal(runtime.infer(batch(4))["logits"], one_hot(4))
        assert runtime.abnormal is True
        assert runtime.providers == ("rules",)
        assert changes == []  # the level it loaded at is not a change
    finally:
        runtime.close()


def test_an_engine_that_cannot_load_here_falls_to_onnxruntime_with_the_reason(tmp_path: Path, onnx_file: Path) -> None:
    path, cfg = version_with(tmp_path, {"model.plan": b"a TensorRT engine for another GPU", "model.onnx": onnx_file})
    runtime = load_runtime(path, cfg, probe_interval_s=0)
    try:
        assert (runtime.level_name, runtime.level_index) == ("onnxruntime", 1)
        [reason] = runtime.failures
        # On a CPU host TensorRT is missing; on a GPU host these bytes are no engine.
        assert reason.startswith("tensorrt: ")
        assert "tensorrt unavailable: " in reason or "could not deserialize the engine" in reason
        assert runtime.abnormal is False
        assert "CPUExecutionProvider" in runtime.providers
        inputs = batch(3)
        np.testing.assert_array_equal(runtime.infer(inputs)["logits"], expected(onnx_file, inputs))
    finally:
        runtime.close()


def test_the_order_picks_and_skips_levels(tmp_path: Path, onnx_file: Path) -> None:
    path, cfg = version_with(tmp_path, {"model.onnx": onnx_file, "rules.json": rules_file(tmp_path / "src")})
    runtime = load_runtime(path, cfg, order=("rules", "onnxruntime"), probe_interval_s=0)
    try:
        assert (runtime.level_name, runtime.level_index, runtime.failures) == ("rules", 0, [])
    finally:
        runtime.close()
    with pytest.raises(RuntimeFailure, match=r"unknown runtimes \['triton'\] in the runtime order"):
        load_runtime(path, cfg, order=("triton", "onnxruntime"))
    with pytest.raises(RuntimeFailure, match=r"holds none of model\.plan: publish a model file"):
        load_runtime(path, cfg, order=("tensorrt",))


def test_no_loadable_level_lists_every_reason(tmp_path: Path) -> None:
    path, cfg = version_with(tmp_path, {"model.onnx": b"junk", "model.plan": b"junk"})
    with pytest.raises(RuntimeFailure, match=r"no runtime could load: tensorrt: .*; onnxruntime: "):
        load_runtime(path, cfg)


def test_the_probe_batch_is_one_row_of_zeros_per_input() -> None:
    cfg = ModelConfig(
        name="m",
        version="v1",
        platform="onnxruntime",
        inputs=[
            {"name": "image", "datatype": "FP32", "shape": [-1, 3, 8, -1]},
            {"name": "ids", "datatype": "INT64", "shape": [-1, 5]},
        ],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        labels=["a", "b"],
        preprocessing={},
    )
    probe = probe_batch(cfg)
    assert {name: (a.shape, a.dtype) for name, a in probe.items()} == {
        "image": ((1, 3, 8, 1), np.dtype(np.float32)),
        "ids": ((1, 5), np.dtype(np.int64)),
    }
    assert not any(a.any() for a in probe.values())


# -- dropping and climbing back -------------------------------------------------------------------


def breakable_chain(
    onnx_file: Path, rules: Path, broken: threading.Event, misuse: list[str]
) -> list[tuple[str, Callable[[], Runtime]]]:
    return [
        ("onnxruntime", lambda: Breakable(OnnxRuntime(onnx_file), broken, misuse)),
        ("rules", partial(RulesRuntime, rules)),
    ]


def test_consecutive_runtime_errors_drop_one_level_and_report_it(tmp_path: Path, onnx_file: Path) -> None:
    broken, misuse = threading.Event(), []
    changes: list[tuple[str, int, str]] = []
    runtime = FallbackRuntime(
        breakable_chain(onnx_file, rules_file(tmp_path), broken, misuse),
        max_consecutive_errors=3,
        probe_interval_s=0,
        on_change=lambda *c: changes.append(c),
    )
    try:
        broken.set()
        for _ in range(2):
            with pytest.raises(RuntimeFailure, match=r"onnxruntime \(level 0\) failed: CUDA error"):
                runtime.infer(batch())
        broken.clear()
        runtime.infer(batch())  # a success in between: the errors are no longer consecutive
        broken.set()
        for _ in range(2):
            with pytest.raises(RuntimeFailure):
                runtime.infer(batch())
        assert (runtime.level_index, changes) == (0, [])
        with pytest.raises(RuntimeFailure):
            runtime.infer(batch())  # the third in a row: it still fails, and the level drops
        assert (runtime.level_name, runtime.level_index, runtime.abnormal) == ("rules", 1, True)
        [(level, index, reason)] = changes
        assert (level, index) == ("rules", 1)
        assert reason.startswith("3 consecutive errors on onnxruntime, last: CUDA error")
        assert runtime.failures == [f"onnxruntime: dropped: {reason}"]
        np.testing.assert_array_equal(runtime.infer(batch(2))["logits"], one_hot(2))
        assert misuse == []
    finally:
        runtime.close()


def test_invalid_input_is_the_callers_fault_and_never_drops_a_level(tmp_path: Path) -> None:
    runtime = FallbackRuntime(
        [("rules", partial(RulesRuntime, rules_file(tmp_path))), ("rules-copy", partial(RulesRuntime, tmp_path / "x"))],
        max_consecutive_errors=1,
        probe_interval_s=0,
    )
    try:
        for _ in range(3):
            with pytest.raises(InvalidInput):
                runtime.infer({})
        assert runtime.level_index == 0 and runtime.failures == []
    finally:
        runtime.close()


def test_dropping_past_the_last_level_leaves_the_model_not_ready(tmp_path: Path, onnx_file: Path) -> None:
    broken, misuse = threading.Event(), []
    changes: list[tuple[str, int, str]] = []
    runtime = FallbackRuntime(
        [("onnxruntime", lambda: Breakable(OnnxRuntime(onnx_file), broken, misuse))],
        max_consecutive_errors=2,
        probe_interval_s=0,
        on_change=lambda *c: changes.append(c),
    )
    try:
        broken.set()
        for _ in range(2):
            with pytest.raises(RuntimeFailure):
                runtime.infer(batch())
        assert (runtime.level_name, runtime.level_index, runtime.name, runtime.providers) == ("none", 1, "none", ())
        assert [c[:2] for c in changes] == [("none", 1)]
        with pytest.raises(ModelNotReady, match="no runtime level is left for this model: onnxruntime: dropped"):
            runtime.infer(batch())
    finally:
        runtime.close()


def test_the_probe_climbs_back_once_the_better_level_answers_again(tmp_path: Path, onnx_file: Path) -> None:
    broken, misuse = threading.Event(), []
    changes: list[tuple[str, int, str]] = []
    runtime = FallbackRuntime(
        breakable_chain(onnx_file, rules_file(tmp_path), broken, misuse),
        max_consecutive_errors=2,
        probe_interval_s=0.05,
        probe_input=batch(1),
        on_change=lambda *c: changes.append(c),
    )
    try:
        broken.set()
        for _ in range(2):
            with pytest.raises(RuntimeFailure):
                runtime.infer(batch())
        assert runtime.level_name == "rules"
        time.sleep(0.3)  # several probes: the level loads but fails the probe batch, so it stays down
        assert runtime.level_name == "rules" and len(changes) == 1
        broken.clear()
        wait_for(lambda: runtime.level_index == 0)
        assert [c[:2] for c in changes] == [("rules", 1), ("onnxruntime", 0)]
        assert changes[1][2] == "probe: onnxruntime loads and answers again"
        inputs = batch(2)
        np.testing.assert_array_equal(runtime.infer(inputs)["logits"], expected(onnx_file, inputs))
        wait_for(lambda: runtime._probe_thread is None)  # back at level 0 the probe stops
        assert misuse == []
    finally:
        runtime.close()


def test_the_probe_climbs_back_once_the_model_file_loads_again(tmp_path: Path, onnx_file: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"truncated during a copy")
    changes: list[tuple[str, int, str]] = []
    runtime = FallbackRuntime(
        [("onnxruntime", partial(OnnxRuntime, model)), ("rules", partial(RulesRuntime, rules_file(tmp_path)))],
        probe_interval_s=0.05,
        probe_input=batch(1),
        on_change=lambda *c: changes.append(c),
    )
    try:
        assert runtime.level_name == "rules"
        assert runtime.failures[0].startswith("onnxruntime: ")
        model.write_bytes(onnx_file.read_bytes())
        wait_for(lambda: runtime.level_index == 0)
        assert [c[:2] for c in changes] == [("onnxruntime", 0)]
        assert runtime.abnormal is False
    finally:
        runtime.close()


def test_level_changes_under_concurrent_batches_never_close_a_runtime_in_use(tmp_path: Path, onnx_file: Path) -> None:
    broken, misuse = threading.Event(), []
    runtime = FallbackRuntime(
        breakable_chain(onnx_file, rules_file(tmp_path), broken, misuse),
        max_consecutive_errors=2,
        probe_interval_s=0.01,
        probe_input=batch(1),
    )
    unexpected: list[BaseException] = []
    stop = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            try:
                out = runtime.infer(batch(2))["logits"]
                assert out.shape == (2, CLASSES)
            except RuntimeFailure:
                pass  # failures while broken are expected
            except BaseException as exc:
                unexpected.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(10):  # break and heal repeatedly while batches run
            broken.set()
            wait_for(lambda: runtime.level_index == 1)
            broken.clear()
            wait_for(lambda: runtime.level_index == 0)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        runtime.close()
    assert unexpected == [] and misuse == []


def test_close_stops_the_probe_and_unloads(tmp_path: Path) -> None:
    runtime = FallbackRuntime(
        [
            ("onnxruntime", partial(OnnxRuntime, tmp_path / "absent.onnx")),
            ("rules", partial(RulesRuntime, rules_file(tmp_path))),
        ],
        probe_interval_s=0.01,
    )
    thread = runtime._probe_thread
    assert thread is not None and thread.is_alive()
    runtime.close()
    assert not thread.is_alive()
    with pytest.raises(ModelNotReady, match="unloaded"):
        runtime.infer(batch())


# -- TensorRT ---------------------------------------------------------------------------------------


def test_tensorrt_unavailable_names_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"engine")
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # what a CPU image without TensorRT looks like
    with pytest.raises(RuntimeFailure, match=r"^tensorrt unavailable: .*tensorrt"):
        TensorRTRuntime(plan)


def gpu_tensorrt_missing() -> str:
    """Why the real TensorRT test cannot run here ("" when it can)."""
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:
        return f"needs TensorRT 10 and an NVIDIA GPU; TensorRT is not importable here ({exc})"
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as exc:
            return f"needs cuda-python next to TensorRT ({exc})"
    error, count = cudart.cudaGetDeviceCount()
    if error != cudart.cudaError_t.cudaSuccess or count == 0:
        return "needs an NVIDIA GPU; TensorRT is installed but CUDA sees no device"
    return ""


@pytest.mark.gpu
@pytest.mark.skipif(bool(gpu_tensorrt_missing()), reason=gpu_tensorrt_missing() or "runs")
def test_tensorrt_runs_an_engine_like_onnxruntime(tmp_path: Path, onnx_file: Path) -> None:
    from tasks.conversion import build_tensorrt_engine

    outcome = build_tensorrt_engine(
        onnx_file, tmp_path / "model.plan", profile=(1, 4, 8), fp16=False, cache_dir=tmp_path / "engines"
    )
    assert outcome.built, outcome.reason
    runtime = TensorRTRuntime(tmp_path / "model.plan")
    try:
        assert runtime.providers[0] == "TensorRT" and runtime.max_batch_size == 8
        for rows in (1, 5, 8):
            inputs = batch(rows, seed=rows)
            np.testing.assert_allclose(runtime.infer(inputs)["logits"], expected(onnx_file, inputs), atol=1e-3)
        with pytest.raises(InvalidInput, match="batch of 9 rows is above the TensorRT engine's optimisation profile"):
            runtime.infer(batch(9))
        results: dict[int, Array] = {}

        def call(seed: int) -> None:
            results[seed] = runtime.infer(batch(4, seed=seed))["logits"]

        threads = [threading.Thread(target=call, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for seed, logits in results.items():
            np.testing.assert_allclose(logits, expected(onnx_file, batch(4, seed=seed)), atol=1e-3)
    finally:
        runtime.close()
