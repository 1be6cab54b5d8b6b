"""GPU utilisation, power and temperature through NVML (``nvidia-ml-py``), read at scrape
time, for the devices the worker serves.

Optional: without the package, without a driver, or on the NumPy backend the collector
yields nothing and says why once in the log. Worker device ids are CUDA ordinals, which
need not be NVML's indices (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER): each device is
matched by its PCI bus id as CUDA reports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


def _cuda_pci_bus_id(device: int) -> str:
    import cupy  # the CuPy backend is running, so this is importable

    return str(cupy.cuda.runtime.deviceGetPCIBusId(device))


class NvmlCollector(Collector):
    """``coliworker_gpu_*`` gauges per served device (label ``device``: the worker's id)."""

    def __init__(
        self,
        devices: Sequence[int],
        nvml: Any = None,
        pci_bus_id: Callable[[int], str] = _cuda_pci_bus_id,
    ) -> None:
        self.handles: dict[int, Any] = {}
        self.nvml = nvml
        if self.nvml is None:
            try:
                import pynvml  # nvidia-ml-py

                self.nvml = pynvml
            except ImportError:
                log.info("GPU utilisation and power metrics off: nvidia-ml-py is not installed")
                return
        try:
            self.nvml.nvmlInit()
            for device in devices:
                bus_id = pci_bus_id(device)
                self.handles[device] = self.nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except Exception as exc:  # no driver, a device NVML does not know: no GPU metrics
            log.warning("GPU utilisation and power metrics off: NVML: %s", exc)
            self.handles = {}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if not self.handles:
            return
        nv, dev = self.nvml, ["device"]
        util = GaugeMetricFamily(
            "coliworker_gpu_utilization_ratio",
            "Fraction of the last sample period in which a kernel ran on the GPU (NVML).",
            labels=dev,
        )
        mem_util = GaugeMetricFamily(
            "coliworker_gpu_memory_bandwidth_utilization_ratio",
            "Fraction of the last sample period in which device memory was read or written.",
            labels=dev,
        )
        power = GaugeMetricFamily("coliworker_gpu_power_watts", "GPU power draw.", labels=dev)
        limit = GaugeMetricFamily(
            "coliworker_gpu_power_limit_watts", "GPU power management limit.", labels=dev
        )
        energy = CounterMetricFamily(
            "coliworker_gpu_energy_joules",
            "GPU energy used since the driver loaded.",
            labels=dev,
        )
        temperature = GaugeMetricFamily(
            "coliworker_gpu_temperature_celsius", "GPU core temperature.", labels=dev
        )
        for device, handle in self.handles.items():
            d = [str(device)]
            # One failing query (a device that fell off the bus) must not fail the scrape.
            try:
                rates = nv.nvmlDeviceGetUtilizationRates(handle)
                util.add_metric(d, rates.gpu / 100.0)
                mem_util.add_metric(d, rates.memory / 100.0)
                power.add_metric(d, nv.nvmlDeviceGetPowerUsage(handle) / 1000.0)
                limit.add_metric(d, nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0)
                energy.add_metric(d, nv.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0)
                temperature.add_metric(d, float(nv.nvmlDeviceGetTemperature(handle, 0)))
            except Exception:
                log.exception("metrics: NVML query for device %d failed", device)
        yield from (util, mem_util, power, limit, energy, temperature)


__all__ = ["NvmlCollector"]
