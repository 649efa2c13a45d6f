"""benchmarks/energy_probe.py (energy per call beside time, for rows at the board's power limit) on this GPU-less
machine: the energy counter read through a fake nvidia-smi, and a window of back-to-back calls turned into
milliseconds, millijoules and watts per call, with the clock samples of that window only."""

import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import energy_probe  # noqa: E402
import gpu_clocks  # noqa: E402


def _counting_smi(tmp_path, step_mj):
    """A fake nvidia-smi whose energy counter (a file) grows by ``step_mj`` at each query, and which records its
    arguments."""
    counter = tmp_path / "counter"
    counter.write_text("1000\n")
    script = tmp_path / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$*" > {tmp_path}/args\nv=$(cat {counter})\n'
                      f'echo $((v + {step_mj})) > {counter}\necho "$v"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_counter_reads_nvidia_smi_for_the_given_gpu(tmp_path):
    energy = energy_probe.EnergyCounter(index=3, nvml=False, command=_counting_smi(tmp_path, 250))
    assert energy.source.endswith("nvidia-smi")
    assert energy.read() == 1000.0 and energy.read() == 1250.0
    assert "--id=3" in (tmp_path / "args").read_text()
    assert "total_energy_consumption" in (tmp_path / "args").read_text()


def test_window_gives_time_energy_and_power_per_call(tmp_path):
    energy = energy_probe.EnergyCounter(nvml=False, command=_counting_smi(tmp_path, 600))
    calls = []
    synced = []

    def call():
        calls.append(time.monotonic())
        time.sleep(0.01)

    clocks = gpu_clocks.ClockSampler(command=str(tmp_path / "absent"))   # never started: samples set by hand
    clocks.stamped = [(0.0, gpu_clocks.Sample(1000, 1, 1, 0)),                     # before the window
                      (float("inf"), gpu_clocks.Sample(1100, 1, 1, 0))]            # after it
    row = energy_probe.sustained(call, 0.2, energy, clocks, sync=lambda: synced.append(1))
    n = len(calls) - 2                                 # two calls ahead of the window (warm-up, then its estimate)
    assert n >= 5 and len(synced) == 3
    # the counter moved by 600 mJ between the window's two reads
    assert row["mJ"] == pytest.approx(600 / n)
    assert row["ms"] >= 10.0
    assert row["W"] == pytest.approx(0.6 / (row["ms"] * n / 1e3))
    assert "MHz" not in row                           # neither sample fell inside the window
    clocks.stamped.append((time.monotonic() + 100, gpu_clocks.Sample(1500, 1, 1, 0)))
    # a sample well inside the next window (its two calls ahead and first counter read take ~30 ms)
    clocks.stamped.insert(1, (time.monotonic() + 0.3, gpu_clocks.Sample(1800, 700, 60, 4)))
    row = energy_probe.sustained(call, 0.6, energy, clocks, sync=lambda: None)
    assert row["MHz"] == 1800


def test_counter_finds_the_board_in_nvml_by_index_or_bus_id(monkeypatch):
    import types
    found = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: found.append(("index", i)) or "h",
        nvmlDeviceGetHandleByPciBusId=lambda bus: found.append(("bus", bus)) or "h",
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: 4200)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert energy_probe.EnergyCounter(2).read() == 4200.0
    counter = energy_probe.EnergyCounter("00000000:1b:00.0")
    assert counter.source == "pynvml" and counter.read() == 4200.0
    assert found == [("index", 2), ("bus", "00000000:1b:00.0")]
