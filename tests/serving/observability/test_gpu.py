"""The NVML collector against a fake NVML module (same functions as pynvml) and without NVML at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest

from serving.observability.gpu import GpuCollector
from serving.observability.metrics import ServerMetrics

GIB = 1024**3


class NVMLError(Exception):
    pass


@dataclass
class FakeNvml:
    """pynvml's surface that the collector uses, over a list of device dicts; counts nvmlInit calls."""

    devices: list[dict[str, Any]]
    inits: int = 0
    utilization_reads: int = 0
    renamed_reasons: bool = True  # nvidia-ml-py >= 12.535 names; False: only the old Throttle name
    calls: list[str] = field(default_factory=list)

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.devices[index]

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> Any:
        return handle["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> Any:
        return SimpleNamespace(used=handle["used"], total=handle["total"], free=handle["total"] - handle["used"])

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> Any:
        self.utilization_reads += 1
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetTemperature(self, handle: dict[str, Any], sensor: int) -> int:
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        if handle.get("temp") is None:
            raise NVMLError("Not Supported")
        return int(handle["temp"])

    def nvmlDeviceGetClockInfo(self, handle: dict[str, Any], clock: int) -> int:
        assert clock == 1  # NVML_CLOCK_SM
        return int(handle["sm_mhz"])

    def __getattr__(self, name: str) -> Any:
        reasons = (
            "nvmlDeviceGetCurrentClocksEventReasons"
            if self.renamed_reasons
            else "nvmlDeviceGetCurrentClocksThrottleReasons"
        )
        if name == reasons:
            return lambda handle: handle["reasons"]
        raise AttributeError(name)


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            {
                "uuid": b"GPU-aaaa",
                "used": 3 * GIB,
                "total": 80 * GIB,
                "util": 42,
                "temp": 61,
                "sm_mhz": 1980,
                "reasons": 0x40,
            },
            {"uuid": "GPU-bbbb", "used": 0, "total": 80 * GIB, "util": 0, "temp": None, "sm_mhz": 345, "reasons": 0x1},
        ]
    )


def test_gauges_per_device_with_units() -> None:
    nvml = two_gpus()
    metrics = ServerMetrics(nvml=lambda: nvml)
    get = metrics.registry.get_sample_value
    first, second = {"gpu": "0", "uuid": "GPU-aaaa"}, {"gpu": "1", "uuid": "GPU-bbbb"}
    assert get("sluicegate_gpu_memory_used_bytes", first) == 3 * GIB
    assert get("sluicegate_gpu_memory_total_bytes", second) == 80 * GIB
    assert get("sluicegate_gpu_utilization_ratio", first) == pytest.approx(0.42)
    assert get("sluicegate_gpu_temperature_celsius", first) == 61
    assert get("sluicegate_gpu_sm_clock_hertz", first) == 1980e6
    assert get("sluicegate_gpu_thermal_throttle", first) == 1  # HW thermal slowdown
    assert get("sluicegate_gpu_thermal_throttle", second) == 0  # GPU idle is not thermal
    # A reading the device does not support is absent, not 0.
    assert get("sluicegate_gpu_temperature_celsius", second) is None
    generate_latest(metrics.registry)
    assert nvml.inits == 1  # initialised once, on the first scrape


def test_older_nvml_names_still_read_thermal_reasons() -> None:
    nvml = two_gpus()
    nvml.renamed_reasons = False
    collector = GpuCollector(lambda: nvml)
    thermal = next(m for m in collector.collect() if m.name == "sluicegate_gpu_thermal_throttle")
    assert [s.value for s in thermal.samples] == [1.0, 0.0]


@pytest.mark.parametrize(
    "loader",
    [
        pytest.param(lambda: (_ for _ in ()).throw(ImportError("No module named 'pynvml'")), id="no-package"),
        pytest.param(lambda: SimpleNamespace(nvmlInit=_raise_driver_not_loaded), id="no-driver"),
        pytest.param(lambda: FakeNvml([]), id="no-device"),
    ],
)
def test_without_nvml_or_a_gpu_the_families_are_absent(loader: Any) -> None:
    metrics = ServerMetrics(nvml=loader)
    text = generate_latest(metrics.registry).decode()
    assert "sluicegate_gpu_" not in text
    assert "sluicegate_inference_requests" in text  # the rest of the registry is unaffected
    assert metrics.gpu.utilization() is None


def _raise_driver_not_loaded() -> None:
    raise NVMLError("Driver Not Loaded")


def test_registering_does_not_start_nvml() -> None:
    nvml = two_gpus()
    ServerMetrics(nvml=lambda: nvml)
    assert nvml.inits == 0


def test_utilization_for_request_logs_is_cached() -> None:
    nvml = two_gpus()
    collector = GpuCollector(lambda: nvml, utilization_max_age_s=60)
    assert collector.utilization(0) == pytest.approx(0.42)
    assert collector.utilization(0) == pytest.approx(0.42)
    assert nvml.utilization_reads == 1
    assert collector.utilization(5) is None  # no such device
    fresh = GpuCollector(lambda: nvml, utilization_max_age_s=0)
    fresh.utilization(1)
    fresh.utilization(1)
    assert nvml.utilization_reads == 3
