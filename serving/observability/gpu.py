"""GPU gauges from NVML, read at scrape time by a custom Prometheus collector.

NVML comes from ``nvidia-ml-py`` (module ``pynvml``), an optional dependency imported on the first
scrape, never at import. Without the package, without a driver or without a device the collector yields
no GPU families at all: an absent series says "no GPU here", where a zero would claim an idle one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

NvmlLoader = Callable[[], Any]  # returns the pynvml module (or a fake with the same functions)

# nvmlClocksEventReason{Sw,Hw}ThermalSlowdown (formerly ...ThrottleReason...): the bits NVML sets while
# the clocks are held down because the GPU is too hot.
THERMAL_REASONS = 0x20 | 0x40
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_CLOCK_SM = 1  # NVML_CLOCK_SM
_LABELS = ("gpu", "uuid")


def import_pynvml() -> Any:
    import pynvml  # nvidia-ml-py, the optional "gpu" extra

    return pynvml


@dataclass(frozen=True)
class _Device:
    index: str
    uuid: str
    handle: Any


class GpuCollector(Collector):
    """``sluicegate_gpu_*`` gauges labelled ``{gpu, uuid}``, one sample per device per scrape.

    Args:
        nvml: Returns the NVML module; default imports ``pynvml``. Called once, on the first use.
        utilization_max_age_s: How long ``utilization()`` reuses a reading (it is called per request).
    """

    def __init__(self, nvml: NvmlLoader | None = None, *, utilization_max_age_s: float = 1.0) -> None:
        self._load = nvml or import_pynvml
        self._lock = threading.Lock()
        self._started = False
        self._nvml: Any = None
        self._devices: tuple[_Device, ...] = ()
        self._max_age_ns = int(utilization_max_age_s * 1e9)
        self._utilization: dict[int, tuple[int, float | None]] = {}  # gpu -> (monotonic ns, ratio)

    def describe(self) -> list[Metric]:
        # Registering must not start NVML (it can take a second); the names are checked at collect time.
        return []

    def collect(self) -> Iterator[Metric]:
        devices = self._start()
        if not devices:
            return
        families = {
            "memory_used": GaugeMetricFamily(
                "sluicegate_gpu_memory_used_bytes", "GPU memory in use (all processes).", labels=_LABELS
            ),
            "memory_total": GaugeMetricFamily(
                "sluicegate_gpu_memory_total_bytes", "GPU memory installed.", labels=_LABELS
            ),
            "utilization": GaugeMetricFamily(
                "sluicegate_gpu_utilization_ratio",
                "Fraction of the last sample period a kernel was running (0..1).",
                labels=_LABELS,
            ),
            "temperature": GaugeMetricFamily(
                "sluicegate_gpu_temperature_celsius", "GPU core temperature.", labels=_LABELS
            ),
            "sm_clock": GaugeMetricFamily("sluicegate_gpu_sm_clock_hertz", "Current SM clock.", labels=_LABELS),
            "thermal": GaugeMetricFamily(
                "sluicegate_gpu_thermal_throttle", "1 while clocks are reduced for temperature.", labels=_LABELS
            ),
        }
        for device in devices:
            labels = [device.index, device.uuid]
            for key, value in self._read(device.handle).items():
                families[key].add_metric(labels, value)
        # A family no device could report (NotSupported everywhere) is left out rather than sent empty.
        yield from (family for family in families.values() if family.samples)

    def utilization(self, gpu: int = 0) -> float | None:
        """GPU ``gpu``'s utilisation (0..1) for request logs, at most ``utilization_max_age_s`` old;
        None without NVML or that device."""
        now = time.monotonic_ns()
        cached = self._utilization.get(gpu)
        if cached is not None and now - cached[0] < self._max_age_ns:
            return cached[1]
        devices = self._start()
        ratio: float | None = None
        if 0 <= gpu < len(devices):
            try:
                ratio = self._nvml.nvmlDeviceGetUtilizationRates(devices[gpu].handle).gpu / 100.0
            except Exception as exc:  # NVMLError: the request is logged without it
                log.debug("NVML utilisation of GPU %d unavailable: %s", gpu, exc)
        self._utilization[gpu] = (now, ratio)
        return ratio

    def _start(self) -> tuple[_Device, ...]:
        """Initialise NVML once; an empty tuple (forever) when it cannot be."""
        if self._started:
            return self._devices
        with self._lock:
            if not self._started:
                self._devices = self._init()
                self._started = True
        return self._devices

    def _init(self) -> tuple[_Device, ...]:
        try:
            nvml = self._load()
            nvml.nvmlInit()
            devices = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                devices.append(_Device(str(index), uuid.decode() if isinstance(uuid, bytes) else str(uuid), handle))
        except Exception as exc:  # ImportError, NVMLError (no driver, no device): no GPU metrics
            log.info("GPU metrics off: NVML unavailable (%s: %s)", type(exc).__name__, exc)
            return ()
        self._nvml = nvml
        log.info("GPU metrics on for %d device(s)", len(devices))
        return tuple(devices)

    def _read(self, handle: Any) -> dict[str, float]:
        """Every reading this device supports now; a failing one is skipped, not reported as 0."""
        nvml = self._nvml
        readers: dict[str, Callable[[], float]] = {
            "memory_used": lambda: float(nvml.nvmlDeviceGetMemoryInfo(handle).used),
            "memory_total": lambda: float(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            "utilization": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            "temperature": lambda: float(nvml.nvmlDeviceGetTemperature(handle, _TEMPERATURE_GPU)),
            "sm_clock": lambda: nvml.nvmlDeviceGetClockInfo(handle, _CLOCK_SM) * 1e6,  # MHz -> Hz
            "thermal": lambda: 1.0 if _clock_reasons(nvml, handle) & THERMAL_REASONS else 0.0,
        }
        values: dict[str, float] = {}
        for key, read in readers.items():
            try:
                values[key] = read()
            except Exception as exc:  # NVMLError_NotSupported and friends
                log.debug("NVML reading %s unavailable: %s", key, exc)
        return values


def _clock_reasons(nvml: Any, handle: Any) -> int:
    # nvidia-ml-py >= 12.535 names it ...ClocksEventReasons; older releases only have ...ThrottleReasons.
    read = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return int(read(handle))
