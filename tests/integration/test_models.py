"""Many models on one embedded stack, with real data nobody here wrote (scikit-learn's digits).

With default training and gate settings and no spec: two datasets of different names, label sets, sizes
(one channel each) land together and train two models with their own champions; the digits model is
measured through the served model on its test split. Then a corrupt version of one stops at its data
gate while another model (with a spec) rolls out, and neither champion moves.
"""

from __future__ import annotations

import csv
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from serving.model_format import read_config
from serving.preprocessing import PreprocessSpec, preprocess
from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pb_grpc
from sluicegate.settings import Settings
from tasks import registry, tracking
from tasks.build import repository_root
from tasks.real_datasets import write_digits
from tasks.sample_data import make_sample
from tasks.transfer import push_directory
from tests.integration.test_stack import stack_running, stack_settings, wait_for_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PCB_SPEC = """
datasets: [pcb]
training: {augment_flips: true, augment_quarter_turns: true, width: 8}
eval_gate: {first_model_min_accuracy: 0.0, baseline_margin: -1.0}
"""


@pytest.fixture(scope="module")
def many_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    # Default training, train gate and eval gate (as a user runs it); only ports, a short canary and a
    # short latency measurement differ.
    base = stack_settings(tmp_path_factory.mktemp("models"))
    settings = Settings(
        **{
            **base.model_dump(exclude={"training", "train_gate", "eval_gate"}),
            "rollout": {**base.rollout.model_dump(), "after_pipeline": True, "hold_seconds": 2.0},
            "eval_gate": {"latency_iterations": 30, "warmup_iterations": 5, "max_latency_ratio": 3.0},
        }
    )
    specs = settings.home / "models"
    specs.mkdir(parents=True)
    (specs / "pcb-classifier.yaml").write_text(PCB_SPEC)
    yield from stack_running(settings)


def push(settings: Settings, directory: Path, name: str, label: str) -> str:
    return push_directory(settings, directory, name, label).manifest_key


def champion(settings: Settings, model: str) -> registry.RegistryVersion | None:
    return registry.alias_holder(settings.mlflow.url, model, registry.CHAMPION)


def served_accuracy(settings: Settings, model: str, directory: Path) -> float:
    """Accuracy of what the local server answers for ``model`` on the dataset's test split, preprocessed
    as the served version's config says (what a client does)."""
    holder = champion(settings, model)
    assert holder is not None
    config = read_config(repository_root(settings) / model / holder.model_version)
    spec = PreprocessSpec.from_dict(config.preprocessing)
    rows = [r for r in csv.DictReader(io.StringIO((directory / "manifest.csv").read_text())) if r["split"] == "test"]
    images = [np.asarray(Image.open(directory / r["path"]).convert("RGB")) for r in rows]
    x = preprocess(images, spec)
    correct = 0
    with grpc.insecure_channel(settings.rollout.local_grpc) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        for start in range(0, len(x), 32):
            batch = np.ascontiguousarray(x[start : start + 32])
            tensor = pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=list(batch.shape))
            request = pb.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[batch.tobytes()])
            response = stub.ModelInfer(request, timeout=30)
            assert response.model_version == holder.model_version
            logits = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(len(batch), -1)
            predicted = [config.labels[i] for i in logits.argmax(axis=1)]
            correct += sum(p == r["label"] for p, r in zip(predicted, rows[start : start + 32], strict=True))
    return correct / len(rows)


def test_two_real_datasets_landing_together_train_two_models_with_their_own_champions(
    many_models: Settings, tmp_path: Path
) -> None:
    settings = many_models
    digits = write_digits(tmp_path / "digits", size=64)
    pair = write_digits(tmp_path / "pair", size=24, classes=(3, 8))
    keys = {"digits": push(settings, digits.directory, "digits", "v1"), "digits-3-8": ""}
    keys["digits-3-8"] = push(settings, pair.directory, "digits-3-8", "v1")
    for model, key in keys.items():
        run = wait_for_run(settings, key, timeout=900)
        assert run["state_type"] == "COMPLETED", (model, run["state"]["message"])

    # Each dataset made its own model, champion and served, with its own input taken from the data.
    for model, (size, labels) in {"digits": (32, 10), "digits-3-8": (24, 2)}.items():
        holder = champion(settings, model)
        assert holder is not None, model
        config = read_config(repository_root(settings) / model / holder.model_version)
        assert config.inputs[0]["shape"] == [-1, 1, size, size] and len(config.labels) == labels
        assert config.preprocessing["colour"] == "L"
        run = tracking.client(settings.mlflow.url).get_run(holder.run_id)
        assert run.data.tags["sluicegate.model"] == model
        # The baselines sit beside the model's metrics, and the model beat them.
        assert run.data.metrics["eval.candidate.accuracy"] >= run.data.metrics["baseline_linear_accuracy"]
        # The default augmentation keeps orientation: a 6 turned over is a 9.
        assert run.data.params["training.augment_flips"] == "False"
    accuracy = served_accuracy(settings, "digits", digits.directory)
    # The linear baseline on 16x16 pixels reaches 0.963 on this split; small CNNs reach 0.98+.
    assert accuracy >= 0.97, accuracy
    assert served_accuracy(settings, "digits-3-8", pair.directory) >= 0.95


def test_a_corrupt_version_of_one_stops_while_another_model_rolls_out(many_models: Settings, tmp_path: Path) -> None:
    settings = many_models
    before = {model: champion(settings, model) for model in ("digits", "digits-3-8")}
    assert all(before.values()), "runs after the two-dataset test"
    corrupt = write_digits(tmp_path / "pair", size=24, classes=(3, 8), seed=1)
    manifest = corrupt.directory / "manifest.csv"
    lines = manifest.read_text().splitlines()
    # A third class the model does not know, on a fifth of the rows: the data gate's known-labels check.
    lines = [line.replace(",3,", ",7,", 1) if i % 5 == 0 else line for i, line in enumerate(lines)]
    manifest.write_text("\n".join(lines) + "\n")
    make_sample(tmp_path / "pcb", count=160, seed=11)

    requests: list[str] = []
    stop = threading.Event()

    def keep_asking() -> None:
        # The untouched model's traffic goes on throughout: it must never fail.
        with grpc.insecure_channel(settings.rollout.local_grpc) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            x = np.zeros((1, 1, 32, 32), dtype=np.float32)
            tensor = pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[1, 1, 32, 32])
            while not stop.wait(0.05):
                request = pb.ModelInferRequest(model_name="digits", inputs=[tensor], raw_input_contents=[x.tobytes()])
                try:
                    requests.append(stub.ModelInfer(request, timeout=10).model_version)
                except grpc.RpcError as exc:
                    requests.append(f"error {exc.code().name}")

    client = threading.Thread(target=keep_asking, daemon=True)
    client.start()
    try:
        bad_key = push(settings, corrupt.directory, "digits-3-8", "v2-corrupt")
        pcb_key = push(settings, tmp_path / "pcb", "pcb", "v1")
        bad = wait_for_run(settings, bad_key, timeout=600)
        good = wait_for_run(settings, pcb_key, timeout=900)
    finally:
        stop.set()
        client.join(30)
    assert bad["state_type"] == "FAILED" and "data gate" in bad["state"]["message"]
    assert "known labels" in bad["state"]["message"]
    assert good["state_type"] == "COMPLETED", good["state"]["message"]
    # The spec named the model and changed its training, visibly in the MLflow run's params.
    pcb = champion(settings, "pcb-classifier")
    assert pcb is not None
    params = tracking.client(settings.mlflow.url).get_run(pcb.run_id).data.params
    assert params["training.augment_flips"] == "True" and params["training.width"] == "8"
    # Neither other champion moved, and the digits traffic never failed.
    after = {model: champion(settings, model) for model in ("digits", "digits-3-8")}
    assert {m: v.model_version for m, v in after.items() if v} == {m: v.model_version for m, v in before.items() if v}
    digits_version = before["digits"].model_version if before["digits"] else ""
    assert requests and set(requests) == {digits_version}
