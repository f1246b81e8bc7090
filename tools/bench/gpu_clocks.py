"""What the GPU ran at during a benchmark run: its SM clock, power draw and temperature, sampled by ``nvidia-smi``
beside the run and summarized over the samples in which the GPU was busy.

Machines of one kind differ by a few percent (docs/PERFORMANCE.md), and a long run may slow as the chip reaches its
power limit: a throughput that carries the clock it ran at tells a slower machine from a slower step. ``nvidia-smi``
ships with the driver; where it is absent or fails, a run carries no clock figures and nothing else changes.
"""

from __future__ import annotations

import atexit
import os
import statistics
import subprocess
import threading
from dataclasses import dataclass

QUERY = "utilization.gpu,clocks.sm,power.draw,temperature.gpu"
BUSY_PERCENT = 90  # samples below this GPU utilization are compilation, loading or idle time, not the step


@dataclass(frozen=True)
class Sample:
    utilization: float  # percent of the sample period in which a kernel ran
    sm_mhz: float
    watts: float
    celsius: float


def parse(line: str) -> Sample | None:
    """One line of ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits``; None where a field is not a
    number (``[N/A]`` on GPUs that do not report it, or a partial line)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        return Sample(*(float(field) for field in fields))
    except ValueError:
        return None


def busy_summary(samples: list[Sample]) -> dict:
    """Median SM clock and power, and the hottest temperature, over the busy samples; {} if none was busy."""
    busy = [s for s in samples if s.utilization >= BUSY_PERCENT]
    if not busy:
        return {}
    return {
        "sm_clock_mhz": statistics.median(s.sm_mhz for s in busy),
        "power_watts": statistics.median(s.watts for s in busy),
        "max_temperature_c": max(s.celsius for s in busy),
        "busy_samples": len(busy),
    }


def visible_gpu() -> str:
    """nvidia-smi's name for CUDA device 0: the first entry of CUDA_VISIBLE_DEVICES (an index or a UUID, which
    ``nvidia-smi --id`` takes as well), else index 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


class GpuClocks:
    """``with GpuClocks() as clocks: ...`` (or ``start()`` ... ``stop()``) samples the GPU every ``interval_ms``
    meanwhile; ``clocks.summary()`` then gives ``busy_summary`` of the samples ({} where nvidia-smi did not run)."""

    def __init__(self, gpu: str | None = None, interval_ms: int = 250, command: str = "nvidia-smi") -> None:
        self.argv = [command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}",
                     f"--id={gpu if gpu is not None else visible_gpu()}"]
        self.samples: list[Sample] = []
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuClocks:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> GpuClocks:
        try:
            self._process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self  # no nvidia-smi: no figures
        self._reader = threading.Thread(target=self._read, args=(self._process.stdout,), name="gpu-clocks",
                                        daemon=True)
        self._reader.start()
        atexit.register(self.stop)  # nvidia-smi loops until stopped: never leave it behind a run that raised
        return self

    def _read(self, stream) -> None:
        for line in stream:  # ends when stop() ends the process
            sample = parse(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return  # not started, nvidia-smi absent, or stopped already
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._reader.join(timeout=5)
        process.stdout.close()
        atexit.unregister(self.stop)

    def summary(self) -> dict:
        return busy_summary(self.samples)
