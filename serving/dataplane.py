"""The protocol-agnostic core of the server: which model versions are loaded, routing by traffic weights,
input validation against each version's config, inference through the version's batcher, and load /
unload while serving. The gRPC servicer and the HTTP side port only convert and call in here."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serving.batching import BatcherStats, DynamicBatcher, Signature, signature
from serving.errors import InvalidInput, ModelNotFound, ModelNotReady, RepositoryError, ServingError
from serving.model_format import ModelConfig
from serving.preprocessing import input_channels
from serving.redact import mask_text, mask_url, masked_traceback
from serving.settings import ServingSettings
from serving.traffic import TrafficSplitter
from serving.types import (
    DATATYPES,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    Tensor,
    TensorMetadata,
)

log = logging.getLogger(__name__)

TRITON_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan", "rules": "rules"}


@dataclass(frozen=True)
class Telemetry:
    """What the data plane reports to: metrics, tracing (None: no span is recorded, so none is made), and
    the telemetry thread that runs the monitors and writes the request log."""

    metrics: Any  # serving.observability.metrics.ServerMetrics
    tracing: Any  # serving.observability.tracing.RequestTracing | None
    pipeline: Any  # serving.observability.pipeline.TelemetryPipeline


@dataclass
class LoadedVersion:
    name: str
    version: str
    path: Path
    config: ModelConfig
    runtime: Any  # serving.runtimes.fallback.FallbackRuntime
    batcher: DynamicBatcher
    loaded_at: float = field(default_factory=time.time)
    monitors: Any = None  # serving.observability.monitors.VersionMonitors (None: telemetry off)
    inputs: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # name -> (datatype, shape)
    outputs: dict[str, str] = field(default_factory=dict)  # name -> datatype, in the config's order
    max_batch_size: int = 1
    plan: Any = None  # serving.grpc_api.fast_infer.InputPlan, built by the gRPC servicer on first use

    def __post_init__(self) -> None:
        self.inputs = {
            str(t["name"]): (str(t["datatype"]), tuple(int(d) for d in t["shape"])) for t in self.config.inputs
        }
        self.outputs = {str(t["name"]): str(t["datatype"]) for t in self.config.outputs}
        self.max_batch_size = int(self.config.to_dict()["batching"]["max_batch_size"])


class DataPlane:
    """Loaded model versions and the operations of the V2 protocol on them.

    Args:
        settings: the server's settings.
        versions: loads the repository: returns ``(model, version, path, config)`` of every version that
            verified, and ``(where, reason)`` of every one that did not.
        on_fallback: called with (model, version, level name, level index, reason) when a version's
            runtime changes level (metrics and logs hook in here).
        telemetry: metrics, tracing and the telemetry thread; None: telemetry off.
        metrics: the server's metrics when telemetry is off (request and engine-cache counters stay on).
    """

    def __init__(
        self,
        settings: ServingSettings,
        versions: Callable[[], tuple[list[tuple[str, str, Path, ModelConfig]], list[tuple[str, str]]]],
        *,
        on_fallback: Callable[[str, str, str, int, str], None] | None = None,
        telemetry: Telemetry | None = None,
        metrics: Any = None,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self._metrics = metrics
        self._engine_cache = None
        if settings.tensorrt_engine_cache:
            from serving.runtimes.engine_cache import EngineCache

            self._engine_cache = EngineCache(Path(settings.cache_dir) / "tensorrt-engines")
        self._scan = versions
        self._on_fallback = on_fallback
        self._lock = threading.RLock()
        self._models: dict[str, dict[str, LoadedVersion]] = {}  # insertion order = load order
        self._states: dict[tuple[str, str], RepositoryEntry] = {}
        self._expected: set[tuple[str, str]] = set()
        self.traffic = TrafficSplitter()
        self._stopping = False
        self._listeners: list[Callable[[bool], None]] = []
        # Held while readiness is computed and delivered, so concurrent changes reach the listeners in
        # order and the last value they saw is the current one.
        self._publish_lock = threading.Lock()

    # -- readiness -------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """Set on shutdown: readiness drops (and is published) while the ports still serve."""
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value
        self.publish_readiness()

    def on_readiness(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(ready)`` now and after every change that may move ``ready()`` (load, unload,
        runtime fallback, shutdown): the gRPC health service and the ready gauge hang here, so they never
        disagree with ServerReady and /health/ready, which ask ``ready()`` directly."""
        with self._publish_lock:
            self._listeners.append(callback)
            callback(self.ready())

    def publish_readiness(self) -> None:
        with self._publish_lock:
            ready = self.ready()
            for callback in self._listeners:
                try:
                    callback(ready)
                except Exception:  # one broken view must not stop a load or the others
                    log.exception("readiness listener %r failed", callback)

    # -- lifecycle -------------------------------------------------------------------------------

    def load_all(self) -> None:
        """Load and warm every version found in the repository; readiness waits for all of them."""
        try:
            found, rejected = self._scan_masked()
            for where, reason in rejected:
                self._reject(where, reason)
            self._expected = {(name, version) for name, version, _, _ in found}
            for name, version, path, config in found:
                self._load_version(name, version, path, config)
        finally:
            self.publish_readiness()

    def _scan_masked(self) -> tuple[list[tuple[str, str, Path, ModelConfig]], list[tuple[str, str]]]:
        """The repository scan; a failure is recorded in the index under the source's name (version "")
        and re-raised, its message masked: it goes to the log, RepositoryIndex and RepositoryModelLoad's
        caller, and a tracking-server or S3 URL in it may carry a password."""
        source = mask_url(self.settings.repository)
        try:
            scanned = self._scan()
        except Exception as exc:
            masked = mask_text(str(exc))
            if not isinstance(exc, ServingError):  # a bug, not a bad source: keep its traceback, masked
                log.error("scanning the repository %s failed:\n%s", source, masked_traceback(exc))
                masked = f"scanning the repository {source} failed: {type(exc).__name__}: {masked}"
            self._states[(source, "")] = RepositoryEntry(source, "", "UNAVAILABLE", masked)
            error = type(exc) if isinstance(exc, ServingError) else RepositoryError
            # Not chained: the cause's message (an httpx or botocore error) may hold the URL in clear.
            raise error(masked) from None
        self._states.pop((source, ""), None)
        return scanned

    def _reject(self, where: str, reason: str) -> None:
        reason = mask_text(reason)  # shown by RepositoryIndex: a source URL in it may carry a password
        log.error("not loading %s: %s", where, reason)
        model, _, version = where.rpartition("/")
        self._states[(model or where, version)] = RepositoryEntry(model or where, version, "UNAVAILABLE", reason)

    def _load_version(self, name: str, version: str, path: Path, config: ModelConfig) -> None:
        from serving.runtimes import LoadOptions, load_runtime

        self._states[(name, version)] = RepositoryEntry(name, version, "LOADING")

        def changed(level: str, index: int, reason: str) -> None:
            log.warning("%s/%s now runs on %s (level %d): %s", name, version, level, index, mask_text(reason))
            if self._on_fallback is not None:
                self._on_fallback(name, version, level, index, reason)
            self.publish_readiness()

        metrics = self.telemetry.metrics if self.telemetry is not None else self._metrics

        def engine_lookup(hit: bool) -> None:
            if metrics is not None:
                metrics.engine_cache_lookup(name, version, hit)

        options = LoadOptions(
            engine_cache=self._engine_cache, fp16=self.settings.tensorrt_fp16, on_engine_lookup=engine_lookup
        )
        try:
            runtime = load_runtime(
                path,
                config,
                order=self.settings.runtime_order,
                ort_threads=self.settings.ort_threads,
                max_consecutive_errors=self.settings.max_consecutive_errors,
                probe_interval_s=self.settings.probe_interval_s,
                on_change=changed,
                options=options,
            )
        except Exception as exc:
            reason = mask_text(str(exc))
            log.error("%s/%s failed to load on every runtime: %s", name, version, reason)
            self._states[(name, version)] = RepositoryEntry(name, version, "UNAVAILABLE", reason)
            self.publish_readiness()
            return
        batching = config.to_dict()["batching"]
        delay = self.settings.max_queue_delay_us
        telemetry = self.telemetry
        monitors = self._monitors(name, version, config)
        batcher = DynamicBatcher(
            runtime.infer,
            max_batch_size=int(batching["max_batch_size"]),
            max_queue_delay_us=int(batching["max_queue_delay_us"] if delay is None else delay),
            max_queue_size=int(batching["max_queue_size"]),
            name=f"{name}/{version}",
            observer=None if telemetry is None else telemetry.metrics.batch_observer(name, version),
            tracer=None if telemetry is None else telemetry.tracing,
            runtime_name=lambda: str(runtime.level_name),
            on_outputs=None if monitors is None else monitors.on_batch,
        )
        loaded = LoadedVersion(name, version, path, config, runtime, batcher, monitors=monitors)
        self._warm_up(loaded)
        log.info("loaded %s/%s on %s (providers: %s)", name, version, runtime.level_name, ", ".join(runtime.providers))
        with self._lock:
            self._models.setdefault(name, {})[version] = loaded
            self._states[(name, version)] = RepositoryEntry(name, version, "READY")
        if metrics is not None:
            metrics.loaded(name, version)  # request metrics label loaded versions only
        self.publish_readiness()

    def _monitors(self, name: str, version: str, config: ModelConfig) -> Any:
        """Drift (when config.json has a training baseline and the model an image input) and
        output-entropy monitors of a version; None with telemetry off."""
        telemetry, s = self.telemetry, self.settings
        if telemetry is None:
            return None
        from serving.observability.drift import DriftMonitor, baseline_features
        from serving.observability.entropy import EntropyMonitor
        from serving.observability.monitors import VersionMonitors

        metrics = telemetry.metrics
        baseline = baseline_features(config.drift_baseline, config.preprocessing)
        image = image_input(
            {str(t["name"]): (str(t["datatype"]), tuple(t["shape"])) for t in config.inputs},
            input_channels(config.preprocessing),
        )
        drift = None
        if baseline is not None and image is not None:
            drift = DriftMonitor(
                baseline,
                window=s.drift_window,
                test_every=s.drift_test_every,
                min_samples=s.drift_min_samples,
                min_interval_s=s.drift_test_min_interval_s,
                ks_threshold=s.drift_ks_threshold,
                p_threshold=s.drift_p_threshold,
                on_report=lambda report: metrics.set_drift(name, version, report.as_metrics(), report.alarm),
            )
        entropy = EntropyMonitor(
            s.entropy_window,
            min_rows=s.entropy_min_rows,
            collapse_std_bits=s.entropy_collapse_std_bits,
            collapse_class_share=s.entropy_collapse_class_share,
        )
        return VersionMonitors(
            name,
            version,
            metrics,
            telemetry.pipeline,
            entropy=entropy,
            logits=str(config.outputs[0]["name"]) if config.outputs else None,
            drift=drift,
            image_input=image,
            preprocessing=config.preprocessing,
        )

    def _warm_up(self, loaded: LoadedVersion) -> None:
        """One batch-1 and one full batch through the runtime, so the first request pays no lazy set-up."""
        for rows in sorted({1, loaded.max_batch_size}):
            batch = {
                name: np.zeros((rows, *(d if d > 0 else 1 for d in shape[1:])), dtype=DATATYPES[datatype])
                for name, (datatype, shape) in loaded.inputs.items()
            }
            try:
                loaded.runtime.infer(batch)
            except Exception as exc:  # a warm-up failure is the fallback chain's business, not fatal here
                log.warning("%s/%s warm-up with %d rows failed: %s", loaded.name, loaded.version, rows, exc)

    def load_model(self, name: str) -> None:
        """(Re)load every version of ``name`` present in the repository, keeping the others serving.

        Versions already loaded stay as they are; versions gone from the repository are unloaded.
        """
        found, _ = self._scan_masked()
        wanted = {version: (path, config) for model, version, path, config in found if model == name}
        if not wanted:
            raise ModelNotFound(f"model {name!r} is not in the repository {mask_url(self.settings.repository)!r}")
        with self._lock:
            present = set(self._models.get(name, {}))
        for version, (path, config) in wanted.items():
            if version not in present:
                self._expected.add((name, version))
                self._load_version(name, version, path, config)
        for version in present - set(wanted):
            self.unload_version(name, version)

    def unload_model(self, name: str) -> None:
        with self._lock:
            versions = list(self._models.get(name, {}))
        if not versions:
            raise ModelNotFound(f"model {name!r} is not loaded")
        for version in versions:
            self.unload_version(name, version)

    def unload_version(self, name: str, version: str) -> None:
        """Stop routing to the version, finish its queued requests, then release it."""
        with self._lock:
            loaded = self._models.get(name, {}).pop(version, None)
            if not self._models.get(name):
                self._models.pop(name, None)
            self.traffic.forget(name, version)
            self._expected.discard((name, version))
            self._states[(name, version)] = RepositoryEntry(name, version, "UNLOADING")
        # Before the drain below: readiness must drop as soon as the version stops taking requests.
        self.publish_readiness()
        if loaded is None:
            return
        loaded.batcher.stop(timeout=self.settings.drain_timeout_s)
        loaded.runtime.close()
        if self.telemetry is not None:
            self.telemetry.metrics.forget(name, version)
        self._states[(name, version)] = RepositoryEntry(name, version, "UNAVAILABLE", "unloaded")

    def close(self) -> None:
        with self._lock:
            everything = [(n, v) for n, versions in self._models.items() for v in versions]
        for name, version in everything:
            self.unload_version(name, version)

    # -- health and metadata ---------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Every version found in the repository at start-up (or loaded since) is loaded and warmed."""
        if self.stopping:
            return False
        with self._lock:
            loaded = {(n, v) for n, versions in self._models.items() for v in versions}
        return bool(self._expected) and self._expected <= loaded

    def model_ready(self, name: str, version: str = "") -> bool:
        with self._lock:
            versions = self._models.get(name, {})
            return bool(versions) if not version else version in versions

    def metadata(self, name: str, version: str = "") -> ModelMetadata:
        loaded = self._get(name, version or None)
        with self._lock:
            versions = tuple(self._models.get(name, {}))
        config = loaded.config
        return ModelMetadata(
            name=name,
            versions=versions,
            platform=TRITON_PLATFORMS.get(config.platform, config.platform),
            inputs=tuple(_tensor_meta(t) for t in config.inputs),
            outputs=tuple(_tensor_meta(t) for t in config.outputs),
        )

    def config(self, name: str, version: str = "") -> dict[str, Any]:
        return self._get(name, version or None).config.to_dict()

    def index(self) -> list[RepositoryEntry]:
        return sorted(self._states.values(), key=lambda e: (e.name, e.version))

    def stats(self, name: str = "", version: str = "") -> list[tuple[str, str, BatcherStats]]:
        with self._lock:
            chosen = [
                (n, v, lv.batcher.stats())
                for n, versions in self._models.items()
                for v, lv in versions.items()
                if (not name or n == name) and (not version or v == version)
            ]
        if name and not chosen:
            raise ModelNotFound(f"model {name!r}{' version ' + repr(version) if version else ''} is not loaded")
        return chosen

    def runtime_of(self, name: str, version: str) -> tuple[str, int, tuple[str, ...]]:
        runtime = self._get(name, version).runtime
        return runtime.level_name, runtime.level_index, tuple(runtime.providers)

    # -- traffic ---------------------------------------------------------------------------------

    def set_weights(self, name: str, weights: Mapping[str, int]) -> dict[str, int]:
        with self._lock:
            loaded = list(self._models.get(name, {}))
            if not loaded:
                raise ModelNotFound(f"model {name!r} is not loaded")
            result = self.traffic.set_weights(name, weights, loaded)
        log.info("traffic weights of %s set to %s", name, result)
        return result

    def weights(self, name: str) -> dict[str, int]:
        if not self.model_ready(name):
            raise ModelNotFound(f"model {name!r} is not loaded")
        return self.traffic.weights(name)

    # -- inference -------------------------------------------------------------------------------

    def infer(self, request: InferRequest) -> InferResponse:
        """The general path (REST, typed gRPC contents): route, validate, run, answer."""
        for attempt in (0, 1):
            loaded = self.route(request.model_name, request.model_version)
            batch = self.validate(loaded, request.inputs)
            rows = next(iter(batch.values())).shape[0]
            try:
                outputs = self.run(loaded, batch, rows, signature(batch))
                break
            except ModelNotReady:
                # Routed to a version being unloaded between choosing it and queueing: choose again, once,
                # unless the client asked for that very version.
                if attempt or request.model_version:
                    raise
        return self.response(loaded, request, outputs)

    def versions(self) -> dict[str, dict[str, LoadedVersion]]:
        """Every loaded version by model, a copy (the native front end's lanes are made from it)."""
        with self._lock:
            return {name: dict(versions) for name, versions in self._models.items()}

    def route(self, name: str, version: str = "") -> LoadedVersion:
        """The version that serves a request: the one named, else one chosen by the traffic weights."""
        return self._get(name, version or None)

    def run(
        self,
        loaded: LoadedVersion,
        batch: dict[str, np.ndarray],
        rows: int,
        sig: Signature,
        count: int = 1,
        batched: bool = False,
    ) -> dict[str, np.ndarray]:
        """Run checked inputs through the version's batcher; this request's rows of every output. ``count``:
        the callers the rows belong to; ``batched``: they are a batch formed already (both: a native lane's,
        see ``DynamicBatcher.call``)."""
        tracing = self.telemetry.tracing if self.telemetry is not None else None
        if tracing is None:
            return loaded.batcher.call(batch, rows, sig, count=count, batched=batched)
        with tracing.queued() as queued:
            return loaded.batcher.call(batch, rows, sig, trace=queued)

    def _get(self, name: str, version: str | None) -> LoadedVersion:
        with self._lock:
            versions = self._models.get(name)
            if not versions:
                known = ", ".join(sorted(self._models)) or "none"
                raise ModelNotFound(f"model {name!r} is not loaded (loaded models: {known})")
            if version:
                found = versions.get(version)
                if found is None:
                    raise ModelNotFound(
                        f"model {name!r} has no loaded version {version!r} (loaded: {', '.join(versions)})"
                    )
                return found
            if len(versions) == 1:  # whatever the weights say, the only loaded version serves (choose's rule)
                return next(iter(versions.values()))
            return versions[self.traffic.choose(name, list(versions))]

    def validate(self, loaded: LoadedVersion, inputs: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """The request's arrays by input name, checked against the version's config."""
        return validate_inputs(loaded.name, loaded.inputs, loaded.max_batch_size, inputs)

    def response(self, loaded: LoadedVersion, request: InferRequest, outputs: dict[str, np.ndarray]) -> InferResponse:
        """The requested outputs (all when none was named) of a run, as the protocol-agnostic answer."""
        declared = loaded.outputs
        wanted = [o.name for o in request.outputs] or list(declared)
        unknown = [name for name in wanted if name not in outputs]
        if unknown:
            raise InvalidInput(
                f"requested output(s) {unknown} do not exist; model {loaded.name!r} has {sorted(declared)}"
            )
        tensors = tuple(
            Tensor(name, declared.get(name, "FP32"), tuple(outputs[name].shape), outputs[name]) for name in wanted
        )
        runtime = str(loaded.runtime.level_name)
        # A rules answer is not the model's: callers must not trust it as one.
        parameters: dict[str, Any] = {"abnormal": True} if runtime == "rules" else {}
        first = outputs.get(next(iter(declared))) if declared else None
        return InferResponse(
            loaded.name,
            loaded.version,
            request.id,
            tensors,
            parameters,
            {"runtime": runtime, "logits": first, "monitors": loaded.monitors},
        )


def validate_inputs(
    model: str,
    expected: Mapping[str, tuple[str, tuple[int, ...]]],
    max_batch_size: int,
    inputs: Sequence[Tensor],
) -> dict[str, np.ndarray]:
    """A request's arrays by input name, checked against a version's inputs (name -> (datatype, shape
    with -1 for free dimensions)) and batch cap; ``InvalidInput`` names the input and the expectation."""
    given = {t.name: t for t in inputs}
    missing, unknown = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or unknown:
        raise InvalidInput(f"model {model!r} takes inputs {sorted(expected)}; missing {missing}, unexpected {unknown}")
    batch: dict[str, np.ndarray] = {}
    rows: int | None = None
    for name, (datatype, shape) in expected.items():
        tensor = given[name]
        if tensor.datatype != datatype:
            raise InvalidInput(f"input {name!r}: datatype {tensor.datatype}, expected {datatype}")
        if len(tensor.shape) != len(shape) or any(
            want != -1 and got != want for got, want in zip(tensor.shape, shape, strict=True)
        ):
            raise InvalidInput(f"input {name!r}: shape {list(tensor.shape)}, expected {list(shape)} (-1: any)")
        count = tensor.shape[0]
        if count < 1 or count > max_batch_size:
            raise InvalidInput(f"input {name!r}: batch of {count}, expected 1 to {max_batch_size} (max_batch_size)")
        if rows is not None and count != rows:
            raise InvalidInput(f"input {name!r}: batch of {count}, other inputs have {rows}")
        rows = count
        batch[name] = tensor.data
    return batch


def image_input(inputs: Mapping[str, tuple[str, tuple[int, ...]]], channels: int = 3) -> str | None:
    """The NCHW image input drift features come from: the first 4-D FP32 input with ``channels`` channels
    (3 for RGB/BGR preprocessing, 1 for "L": ``serving.observability.drift.input_channels``)."""
    for name, (datatype, shape) in inputs.items():
        if datatype == "FP32" and len(shape) == 4 and int(shape[1]) == channels:
            return name
    return None


def _tensor_meta(tensor: Mapping[str, Any]) -> TensorMetadata:
    return TensorMetadata(str(tensor["name"]), str(tensor["datatype"]), tuple(int(d) for d in tensor["shape"]))
