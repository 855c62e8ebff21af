"""The observability settings: defaults agree with the monitors', the environment overrides them, and
the modules import only serving dependencies (heavy ones lazily)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from serving.observability.drift import DriftMonitor
from serving.observability.entropy import EntropyMonitor
from serving.settings import ServingSettings

ROOT = Path(__file__).resolve().parents[3]


def defaults(cls: type) -> dict[str, object]:
    return {name: p.default for name, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}


def test_setting_defaults_are_the_monitor_defaults() -> None:
    settings = ServingSettings()
    drift, entropy = defaults(DriftMonitor), defaults(EntropyMonitor)
    assert (settings.drift_window, settings.drift_test_every, settings.drift_min_samples) == (
        drift["window"],
        drift["test_every"],
        drift["min_samples"],
    )
    assert (settings.drift_ks_threshold, settings.drift_p_threshold) == (drift["ks_threshold"], drift["p_threshold"])
    assert (settings.entropy_window, settings.entropy_min_rows) == (entropy["window"], entropy["min_rows"])
    assert settings.entropy_collapse_std_bits == entropy["collapse_std_bits"]
    assert settings.entropy_collapse_class_share == entropy["collapse_class_share"]
    assert (settings.log_sample_rate, settings.tracing_exporter, settings.tracing_endpoint) == (1.0, "none", None)
    assert all(field.description for field in ServingSettings.model_fields.values())


def test_environment_sets_them_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICEGATE_SERVING__TRACING_EXPORTER", "otlp")
    monkeypatch.setenv("SLUICEGATE_SERVING__TRACING_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("SLUICEGATE_SERVING__LOG_SAMPLE_RATE", "0.25")
    settings = ServingSettings()
    assert (settings.tracing_exporter, settings.tracing_endpoint, settings.log_sample_rate) == (
        "otlp",
        "http://collector:4317",
        0.25,
    )
    with pytest.raises(ValidationError, match="log_sample_rate"):
        ServingSettings(log_sample_rate=2)
    with pytest.raises(ValidationError, match="tracing_exporter"):
        ServingSettings(tracing_exporter="memory")  # tests only, never a deployment


def test_modules_import_only_serving_dependencies_and_heavy_ones_lazily() -> None:
    probe = (
        "import sys, serving.observability.metrics, serving.observability.drift, serving.observability.entropy, "
        "serving.observability.logs; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    loaded = set(result.stdout.split())
    assert not loaded & {"torch", "prefect", "mlflow", "sluicegate", "tasks", "flows", "pandas"}
    # scipy comes with the first drift test, pynvml with the first scrape, OpenTelemetry with tracing.py.
    assert not loaded & {"scipy", "pynvml", "opentelemetry"}
