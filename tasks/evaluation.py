"""Gate 5's measurements: the candidate and the champion scored on the same test images, through the
serving runtime (``serving.runtimes``) and the serving preprocessing, side by side in one run.

Quality: accuracy, per-class precision/recall/F1 and the confusion matrix (scikit-learn), expected
calibration error. Speed: p50/p95 latency per batch size, measured interleaved (candidate call,
champion call, candidate call ...) so that whatever else the machine does at that moment lands on both
models alike, instead of on whichever happened to be measured second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from serving.model_format import verify_version
from serving.preprocessing import PreprocessSpec, preprocess
from tasks.dataset_source import DatasetSource

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ModelUnderTest:
    """One verified model version folder and what serving needs to run it."""

    role: str  # "candidate" or "champion"
    model_version: str
    model_file: Path
    labels: tuple[str, ...]
    spec: PreprocessSpec
    input_name: str
    output_name: str


def model_under_test(role: str, version_dir: Path) -> ModelUnderTest:
    """Verify a repository version folder (sha256 sums, no pickles) and describe it for evaluation."""
    config = verify_version(version_dir)
    return ModelUnderTest(
        role=role,
        model_version=config.version,
        model_file=version_dir / "model.onnx",
        labels=tuple(config.labels),
        spec=PreprocessSpec.from_dict(config.preprocessing),
        input_name=str(config.inputs[0]["name"]),
        output_name=str(config.outputs[0]["name"]),
    )


@dataclass(frozen=True)
class EvalOptions:
    batch_sizes: tuple[int, ...] = (1, 8)
    latency_iterations: int = 200
    warmup_iterations: int = 20
    threads: int = 1
    calibration_bins: int = 15
    predict_batch: int = 64
    latency_retries: int = 0


@dataclass(frozen=True)
class ClassMetrics:
    label: str
    precision: float
    recall: float
    f1: float
    support: int


@dataclass(frozen=True)
class CalibrationBin:
    lower: float
    upper: float
    count: int
    confidence: float  # mean top-1 probability in the bin (nan when empty)
    accuracy: float  # share correct in the bin (nan when empty)


@dataclass(frozen=True)
class Latency:
    batch_size: int
    p50_ms: float
    p95_ms: float
    mean_ms: float
    iterations: int


@dataclass(frozen=True)
class Evaluation:
    role: str
    model_version: str
    runtime: str
    providers: tuple[str, ...]
    model_labels: tuple[str, ...]  # the model's own outputs, in index order
    samples: int
    accuracy: float
    ece: float
    axis: tuple[str, ...]  # confusion-matrix rows (true) and columns (predicted)
    confusion: tuple[tuple[int, ...], ...]
    per_class: tuple[ClassMetrics, ...]
    calibration: tuple[CalibrationBin, ...]
    latency: tuple[Latency, ...]
    unknown_label_samples: int  # test images whose label this model has no output for (always wrong)
    latency_attempts: int = 1  # > 1: the latency was re-measured because the first measurement tripped the rule

    def latency_at(self, batch_size: int) -> Latency | None:
        return next((entry for entry in self.latency if entry.batch_size == batch_size), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_test_split(
    source: DatasetSource, manifest: bytes, *, limit: int, seed: int = 0, concurrency: int = 16
) -> tuple[list[npt.NDArray[np.uint8]], list[str]]:
    """Decoded images and labels of the test split (at most ``limit``: a seeded subset, the same every run).

    Raises:
        DatasetError: the split has no labelled rows or none of its images decode.
    """
    from tasks.training_data import decode_or_none, read_labelled

    return read_labelled(
        source,
        manifest,
        "test",
        decode_or_none,
        limit=limit,
        seed=seed,
        concurrency=concurrency,
        reader="the evaluation gate",
    )


def softmax(logits: Float32Array) -> Float32Array:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    probs: Float32Array = (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)
    return probs


def calibration(
    confidence: Float32Array, correct: npt.NDArray[np.bool_], bins: int
) -> tuple[float, list[CalibrationBin]]:
    """Expected calibration error over equal-width confidence bins (Guo et al., 2017) and the bins.

    Written here because scikit-learn's ``calibration_curve`` is for binary problems and drops empty
    bins, while ECE is the multi-class top-1 version weighted by each bin's share of samples.
    """
    edges = np.linspace(0.0, 1.0, bins + 1)
    # Right-closed bins, (lower, upper]; a confidence of exactly 0 cannot occur after softmax.
    index = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
    total = len(confidence)
    ece = 0.0
    out: list[CalibrationBin] = []
    for b in range(bins):
        members = index == b
        count = int(members.sum())
        if count:
            conf, acc = float(confidence[members].mean()), float(correct[members].mean())
            ece += count / total * abs(acc - conf)
        else:
            conf = acc = float("nan")
        out.append(CalibrationBin(float(edges[b]), float(edges[b + 1]), count, conf, acc))
    return ece, out


def classification_metrics(
    true: Sequence[str], predicted: Sequence[str], axis: Sequence[str]
) -> tuple[float, tuple[tuple[int, ...], ...], tuple[ClassMetrics, ...]]:
    """Accuracy, confusion matrix (rows true, columns predicted, in ``axis`` order) and per-class scores."""
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    labels = list(axis)
    matrix = confusion_matrix(list(true), list(predicted), labels=labels)
    precision, recall, f1, support = precision_recall_fscore_support(
        list(true), list(predicted), labels=labels, zero_division=0
    )
    accuracy = float(np.trace(matrix) / max(1, matrix.sum()))
    per_class = tuple(
        ClassMetrics(label, float(p), float(r), float(f), int(s))
        for label, p, r, f, s in zip(labels, precision, recall, f1, support, strict=True)
    )
    return accuracy, tuple(tuple(int(v) for v in row) for row in matrix), per_class


def percentile_ms(samples_ns: Sequence[int], q: float) -> float:
    return float(np.percentile(np.asarray(samples_ns, dtype=np.float64), q) / 1e6)


def evaluate(
    models: Sequence[ModelUnderTest],
    images: Sequence[npt.NDArray[np.uint8]],
    labels: Sequence[str],
    options: EvalOptions,
    remeasure: Callable[[Sequence[Evaluation]], bool] | None = None,
) -> list[Evaluation]:
    """Score every model on the same images, each through its own preprocessing spec and ONNX Runtime.

    Args:
        models: the candidate first, then the champion if there is one (roles must differ).
        images: decoded RGB uint8 ``(H, W, 3)`` test images.
        labels: the true label of each image.
        options: latency and calibration settings.
        remeasure: asked after each latency measurement; True measures latency again (at most
            ``options.latency_retries`` times), for a rule that one noisy measurement should not trip.

    Returns:
        One ``Evaluation`` per model, in the order given.
    """
    from serving.runtimes.onnxruntime import OnnxRuntime

    if len(images) != len(labels) or not images:
        raise ValueError(f"need the same positive number of images and labels, got {len(images)} and {len(labels)}")
    if len({m.role for m in models}) != len(models):
        raise ValueError(f"model roles must be distinct, got {[m.role for m in models]}")
    axis = tuple(sorted(set(labels).union(*(m.labels for m in models))))
    runtimes = {m.role: OnnxRuntime(m.model_file, intra_op_threads=options.threads) for m in models}
    inputs = {m.role: preprocess(list(images), m.spec) for m in models}
    try:
        latency = measure_latency({m.role: (runtimes[m.role], m.input_name, inputs[m.role]) for m in models}, options)
        results = [
            _score(model, runtimes[model.role], inputs[model.role], labels, axis, latency[model.role], options)
            for model in models
        ]
        subjects = {m.role: (runtimes[m.role], m.input_name, inputs[m.role]) for m in models}
        for attempt in range(2, options.latency_retries + 2):
            if remeasure is None or not remeasure(results):
                break
            again = measure_latency(subjects, options)
            results = [replace(r, latency=again[r.role], latency_attempts=attempt) for r in results]
        return results
    finally:
        for runtime in runtimes.values():
            runtime.close()


def _score(
    model: ModelUnderTest,
    runtime: Any,
    x: Float32Array,
    labels: Sequence[str],
    axis: tuple[str, ...],
    latency: tuple[Latency, ...],
    options: EvalOptions,
) -> Evaluation:
    """One model's quality on the preprocessed images ``x`` (true ``labels``), with its measured latency."""
    logits = _predict(runtime, model, x, options.predict_batch)
    probs = softmax(logits)
    predicted = [model.labels[i] for i in probs.argmax(axis=1)]
    correct = np.asarray([p == t for p, t in zip(predicted, labels, strict=True)])
    accuracy, matrix, per_class = classification_metrics(labels, predicted, axis)
    ece, bins = calibration(probs.max(axis=1), correct, options.calibration_bins)
    return Evaluation(
        role=model.role,
        model_version=model.model_version,
        runtime=runtime.name,
        providers=runtime.providers,
        model_labels=model.labels,
        samples=len(labels),
        accuracy=accuracy,
        ece=ece,
        axis=axis,
        confusion=matrix,
        per_class=per_class,
        calibration=tuple(bins),
        latency=latency,
        unknown_label_samples=sum(1 for t in labels if t not in model.labels),
    )


def _predict(runtime: Any, model: ModelUnderTest, x: Float32Array, batch: int) -> Float32Array:
    chunks = [
        np.asarray(runtime.infer({model.input_name: x[i : i + batch]})[model.output_name], dtype=np.float32)
        for i in range(0, len(x), batch)
    ]
    logits = np.concatenate(chunks)
    if logits.ndim != 2 or logits.shape[1] != len(model.labels):
        raise ValueError(
            f"{model.role} {model.model_version}: output {model.output_name!r} has shape {logits.shape}, "
            f"expected (N, {len(model.labels)}) for its labels {list(model.labels)}"
        )
    return logits


def measure_latency(
    subjects: Mapping[str, tuple[Any, str, Float32Array]], options: EvalOptions
) -> dict[str, tuple[Latency, ...]]:
    """Per role, p50/p95/mean milliseconds of one ``infer`` call at each batch size, interleaved across roles.

    ``subjects`` maps a role to (runtime, input name, preprocessed images); a batch is the first
    ``batch_size`` images (repeated when there are fewer).
    """
    out: dict[str, list[Latency]] = {role: [] for role in subjects}
    for size in options.batch_sizes:
        batches = {role: _batch_of(x, size) for role, (_, _, x) in subjects.items()}
        samples: dict[str, list[int]] = {role: [] for role in subjects}
        for round_ in range(options.warmup_iterations + options.latency_iterations):
            # Alternate who goes first each round, so neither model always runs on a cache the other warmed.
            order = list(subjects) if round_ % 2 == 0 else list(subjects)[::-1]
            for role in order:
                runtime, name, _ = subjects[role]
                start = time.perf_counter_ns()
                runtime.infer({name: batches[role]})
                elapsed = time.perf_counter_ns() - start
                if round_ >= options.warmup_iterations:
                    samples[role].append(elapsed)
        for role, values in samples.items():
            out[role].append(
                Latency(
                    batch_size=size,
                    p50_ms=percentile_ms(values, 50),
                    p95_ms=percentile_ms(values, 95),
                    mean_ms=float(np.mean(values) / 1e6),
                    iterations=len(values),
                )
            )
    return {role: tuple(values) for role, values in out.items()}


def _batch_of(x: Float32Array, size: int) -> Float32Array:
    if len(x) >= size:
        return np.ascontiguousarray(x[:size])
    return np.ascontiguousarray(np.resize(x, (size, *x.shape[1:])))
