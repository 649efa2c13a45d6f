"""The GPU's clocks, power and throttle reasons sampled while a benchmark runs, so that a slow pass can be told
from a slow kernel: ``nvidia-smi`` polled every ``interval_ms`` in a background process, each sample stamped as it
arrives and summarised over a window of time (one timed pass).

    with ClockSampler() as clocks:
        t0 = time.monotonic(); run_the_row(); t1 = time.monotonic()
        print(clocks.summary(t0, t1))   # "SM 1980 MHz (min 1755), 512 W (max 690), 61 C, throttled: sw_power_cap 40%"

Used by ``ab_forward.py --clocks`` (a GPU at its power cap slows some passes of a long row). Where ``nvidia-smi`` is
missing or fails, the summary says so and the benchmark runs on.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Optional

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
# newer drivers name the last field clocks_event_reasons.active; tried when the first query is refused
QUERY_NEWER = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

# bits of clocks_throttle_reasons.active (NVML's nvmlClocksThrottleReasons)
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks",
}


@dataclass
class Sample:
    sm_mhz: float
    power_w: float
    temperature_c: float
    reasons: int


def parse_samples(text: str) -> list:
    """``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`` lines -> samples (lines it cannot read, such as
    ``[N/A]`` fields, are skipped)."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            samples.append(Sample(float(fields[0]), float(fields[1]), float(fields[2]), int(fields[3], 0)))
        except ValueError:
            continue
    return samples


def summarize(samples: list) -> str:
    """One line: median and least SM clock, median and largest power, hottest temperature, and each throttle
    reason with the share of samples it was active in (idle left out: the GPU idles between launches)."""
    if not samples:
        return "no clock samples"
    clocks = [s.sm_mhz for s in samples]
    power = [s.power_w for s in samples]
    shares = []
    for bit, name in THROTTLE_REASONS.items():
        if bit == 0x1:
            continue
        n = sum(1 for s in samples if s.reasons & bit)
        if n:
            shares.append(f"{name} {100 * n / len(samples):.0f}%")
    return (f"SM {statistics.median(clocks):.0f} MHz (min {min(clocks):.0f}), {statistics.median(power):.0f} W "
            f"(max {max(power):.0f}), {max(s.temperature_c for s in samples):.0f} C, "
            f"throttled: {', '.join(shares) if shares else 'none'} ({len(samples)} samples)")


def smi_id(index: Optional[int] = None) -> str:
    """The id under which nvidia-smi and NVML know torch's CUDA device ``index`` (default: the current one): its PCI
    bus id where torch reports it, else the CUDA index. Why: CUDA's indices follow ``CUDA_VISIBLE_DEVICES`` (and put
    the fastest board first), NVML's follow the bus, so the two can name different boards by the same number."""
    import torch

    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    if all(hasattr(props, k) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return str(index)


class ClockSampler:
    """``nvidia-smi`` polling in the background for the duration of a ``with`` block (GPU ``index``: an index, UUID or
    PCI bus id, as ``smi_id`` gives); each sample is stamped with ``time.monotonic()`` as it arrives, so that
    ``summary(t0, t1)`` speaks of one timed pass."""

    def __init__(self, interval_ms: int = 20, index=0, command: str = "nvidia-smi"):
        self.command, self.interval_ms, self.index = command, interval_ms, index
        self.proc: Optional[subprocess.Popen] = None
        self.reader: Optional[threading.Thread] = None
        self.stamped: list = []          # (monotonic seconds, Sample)
        self.error: Optional[str] = None

    def _read(self):
        for line in self.proc.stdout:
            for sample in parse_samples(line):
                self.stamped.append((time.monotonic(), sample))

    def _query(self, fields: str) -> list:
        return [self.command, f"--query-gpu={fields}", "--format=csv,noheader,nounits", f"--id={self.index}"]

    def __enter__(self):
        # one query first, to choose the field names this driver takes (and fail early where there is none)
        err = ""
        for fields in (QUERY, QUERY_NEWER):
            try:
                once = subprocess.run(self._query(fields), capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired) as e:
                self.error = f"nvidia-smi unavailable ({e})"
                return self
            if once.returncode == 0 and parse_samples(once.stdout):
                break
            err = (once.stderr or once.stdout).strip()
        else:
            self.error = f"nvidia-smi: {err.splitlines()[-1] if err else 'no samples'}"
            return self
        try:
            self.proc = subprocess.Popen(self._query(fields) + [f"--loop-ms={self.interval_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError as e:
            self.error = f"nvidia-smi unavailable ({e})"
            return self
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=5)       # the reader alone reads stdout, to its end
            self.proc.stdout.close()
        return False

    def summary(self, t0: float = float("-inf"), t1: float = float("inf")) -> str:
        """The samples that arrived between monotonic times ``t0`` and ``t1`` (all by default), summarised."""
        if self.error:
            return self.error
        return summarize([s for t, s in self.stamped if t0 <= t <= t1])
