"""A one-channel (preprocessing colour "L") model served end to end: a real exported ONNX model that takes
(N, 1, H, W), written with write_version, loaded by the real server, asked over gRPC with Triton's client,
and watched for drift on its one grey feature."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
import tritonclient.grpc as triton
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from tritonclient.utils import InferenceServerException

from serving.errors import RepositoryError
from serving.model_format import ModelConfig, write_version
from serving.preprocessing import PreprocessSpec, preprocess
from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tasks.conversion import export_onnx
from tasks.image_stats import channel_baseline, image_stats

MODEL = "grey"
LABELS = ("bridge", "good", "missing", "shifted")
SPEC = PreprocessSpec(height=24, width=24, colour="L", mean=(0.45,), std=(0.25,))


class GreyNet(nn.Module):
    """A tiny classifier whose first convolution takes one channel."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.features = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(6, len(LABELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x))
        return out


def grey_pictures(count: int, rng: np.random.Generator, size: int = 30) -> list[np.ndarray]:
    """Grey (H, W) uint8 images, each with its own brightness, so per-image means spread out."""
    levels = rng.uniform(60, 200, size=(count, 1, 1))
    noise = rng.normal(0, 20, size=(count, size, size))
    return list(np.clip(levels + noise, 0, 255).astype(np.uint8))


def as_rgb(grey: np.ndarray) -> np.ndarray:
    """What decode_rgb gives for a grey file: the band copied into R, G and B."""
    return np.repeat(grey[..., None], 3, axis=-1)


def png(grey: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(grey, mode="L").save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[GreyNet, Path]:
    net = GreyNet().eval()
    work = tmp_path_factory.mktemp("export")
    export_onnx(net, np.zeros((1, 1, SPEC.height, SPEC.width), dtype=np.float32), work / "model.onnx")
    return net, work / "model.onnx"


@pytest.fixture(scope="module")
def served(model: tuple[GreyNet, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    # The baseline as the pipeline writes it: channel_baseline over image_stats of grey PNGs (r == g == b);
    # the server derives the grey feature from it.
    stats = [
        image_stats(f"{i}.png", png(image)) for i, image in enumerate(grey_pictures(300, np.random.default_rng(0)))
    ]
    config = ModelConfig(
        name=MODEL,
        version="1",
        platform="onnxruntime",
        inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, 1, SPEC.height, SPEC.width]}],
        outputs=[{"name": "logits", "datatype": "FP32", "shape": [-1, len(LABELS)]}],
        labels=list(LABELS),
        preprocessing=SPEC.to_dict(),
        batching={"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256},
        drift_baseline=channel_baseline(stats),
    )
    write_version(repo, config, {"model.onnx": model[1]})
    settings = ServingSettings(
        repository=str(repo),
        grpc_port=0,
        http_port=0,
        cache_dir=tmp_path_factory.mktemp("cache"),
        probe_interval_s=0,
        drift_window=200,
        drift_test_every=40,
        drift_min_samples=80,
        drift_test_min_interval_s=0,  # tests by count: 40 images arrive faster than once a second
    )
    running = start(settings)
    assert running.wait_ready(120), running.dataplane.index()
    yield running
    running.stop(grace=5)


def infer(server: RunningServer, x: np.ndarray) -> np.ndarray:
    c = triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    out = c.infer(MODEL, [given]).as_numpy("logits")
    assert out is not None
    return np.asarray(out)


def drift_metrics(server: RunningServer) -> tuple[dict[str, float], float]:
    """The model's KS statistic per feature and its alarm, from /metrics."""
    assert server.flush_telemetry(30)
    text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics").text
    ks: dict[str, float] = {}
    alarm = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != MODEL:
                continue
            if sample.name == "sluicegate_feature_drift_ks_statistic":
                ks[sample.labels["feature"]] = sample.value
            elif sample.name == "sluicegate_feature_drift_alarm":
                alarm = sample.value
    return ks, alarm


def test_a_one_channel_model_answers_like_onnx_runtime_and_torch(
    served: RunningServer, model: tuple[GreyNet, Path]
) -> None:
    c = triton.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    meta = c.get_model_metadata(MODEL, as_json=True)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "1", "24", "24"]}]
    x = preprocess([as_rgb(image) for image in grey_pictures(5, np.random.default_rng(1), size=40)], SPEC)
    assert x.shape == (5, 1, 24, 24)
    got = infer(served, x)
    session = ort.InferenceSession(str(model[1]), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, session.run(None, {"input": x})[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        expected = model[0](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_a_three_channel_request_is_refused_naming_the_shape(served: RunningServer) -> None:
    rgb = preprocess([as_rgb(grey_pictures(1, np.random.default_rng(2))[0])], PreprocessSpec(height=24, width=24))
    with pytest.raises(InferenceServerException, match=r"shape \[1, 3, 24, 24\], expected \[-1, 1, 24, 24\]"):
        infer(served, rgb)


def test_the_grey_feature_is_watched_for_drift(served: RunningServer) -> None:
    rng = np.random.default_rng(3)
    for _ in range(15):  # 120 in-distribution images, 8 a request
        infer(served, preprocess([as_rgb(image) for image in grey_pictures(8, rng)], SPEC))
    ks, alarm = drift_metrics(served)
    assert set(ks) == {"l"} and alarm == 0, ks
    dark = preprocess([np.full((30, 30, 3), 5, dtype=np.uint8)] * 8, SPEC)
    for _ in range(20):
        infer(served, dark)
    ks, alarm = drift_metrics(served)
    assert alarm == 1 and ks["l"] > 0.15, ks


def grey_config(shape: list[int], colour: str = "L") -> ModelConfig:
    spec = SPEC if colour == "L" else PreprocessSpec(height=24, width=24, colour=colour)  # type: ignore[arg-type]
    return ModelConfig(
        name=MODEL,
        version="1",
        platform="onnxruntime",
        inputs=[{"name": "input", "datatype": "FP32", "shape": shape}],
        outputs=[{"name": "logits", "datatype": "FP32", "shape": [-1, len(LABELS)]}],
        labels=list(LABELS),
        preprocessing=spec.to_dict(),
    )


def test_a_config_whose_image_input_disagrees_with_its_colour_is_refused() -> None:
    assert grey_config([-1, 1, 24, 24]).inputs[0]["shape"][1] == 1
    assert grey_config([-1, -1, 24, 24]).preprocessing["colour"] == "L"  # a free channel axis takes either
    with pytest.raises(
        RepositoryError, match=r"colour 'L' makes \(N, 1, H, W\) .*shape \[-1, 3, 24, 24\].*\[-1, 1, H, W\]"
    ):
        grey_config([-1, 3, 24, 24])
    with pytest.raises(RepositoryError, match=r"colour 'RGB' makes \(N, 3, H, W\) .*\[-1, 3, H, W\]"):
        grey_config([-1, 1, 24, 24], colour="RGB")
