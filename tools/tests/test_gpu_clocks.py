"""tools/gpu_clocks.py (what ``ab_forward.py --clocks`` prints beside each timed pass), without a GPU: nvidia-smi's
CSV lines parsed and summarised, samples stamped as they arrive and kept to a pass's window of time, and a missing
or failing nvidia-smi reported instead of stopping the benchmark."""

import stat
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_clocks  # noqa: E402


def test_samples_parse_and_summarise_with_their_throttle_reasons():
    text = "1980, 512.3, 55, 0x0000000000000000\n1755, 690.0, 61, 0x0000000000000004\n[N/A], 1, 2, 0x0\n" \
           "1830, 600.5, 58, 0x0000000000000005\n"
    samples = gpu_clocks.parse_samples(text)
    assert [s.sm_mhz for s in samples] == [1980, 1755, 1830]        # the [N/A] line skipped
    assert [s.reasons for s in samples] == [0, 4, 5]
    line = gpu_clocks.summarize(samples)
    assert line.startswith("SM 1830 MHz (min 1755), 600 W (max 690), 61 C, ")
    assert "sw_power_cap 67%" in line and "gpu_idle" not in line and line.endswith("(3 samples)")
    assert gpu_clocks.summarize(samples[:1]).endswith("throttled: none (1 samples)")
    assert gpu_clocks.summarize([]) == "no clock samples"


def _fake_smi(tmp_path, body):
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_sampler_keeps_each_pass_to_its_window(tmp_path):
    # the fake answers the first (one-shot) query with one line, the looping one (--loop-ms) with two, 0.5 s apart
    smi = _fake_smi(tmp_path, 'case "$*" in *--loop-ms*) ;; *) echo "1, 1, 1, 0x0"; exit 0;; esac\n'
                              "echo '1980, 500, 50, 0x0'\nsleep 0.5\necho '1400, 700, 70, 0x4'\nexec sleep 30\n")
    with gpu_clocks.ClockSampler(command=smi) as clocks:
        deadline = time.monotonic() + 10
        while len(clocks.stamped) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (t_first, _), (t_second, _) = clocks.stamped
    assert t_second - t_first >= 0.4
    assert clocks.summary(t_first - 0.01, t_first + 0.01).startswith("SM 1980 MHz (min 1980)")
    assert "sw_power_cap 100%" in clocks.summary(t_second - 0.01, t_second + 0.01)
    assert clocks.summary().endswith("(2 samples)")


def test_a_missing_or_failing_nvidia_smi_is_reported(tmp_path):
    with gpu_clocks.ClockSampler(command=str(tmp_path / "absent")) as clocks:
        pass
    assert clocks.summary().startswith("nvidia-smi unavailable")
    smi = _fake_smi(tmp_path, "echo 'No devices were found' >&2\nexit 6\n")
    with gpu_clocks.ClockSampler(command=smi) as clocks:
        pass
    assert clocks.summary() == "nvidia-smi: No devices were found"


def test_the_newer_drivers_field_name_is_tried_when_the_first_is_refused(tmp_path):
    smi = _fake_smi(tmp_path, 'case "$*" in *clocks_throttle_reasons*) '
                              'echo \'Field "clocks_throttle_reasons.active" is not a valid field to query.\'; exit 2;; '
                              'esac\ncase "$*" in *--loop-ms*) echo "1755, 650, 66, 0x4"; exec sleep 30;; esac\n'
                              'echo "1, 1, 1, 0x0"\n')
    with gpu_clocks.ClockSampler(command=smi) as clocks:
        deadline = time.monotonic() + 10
        while not clocks.stamped and time.monotonic() < deadline:
            time.sleep(0.05)
    assert clocks.summary().startswith("SM 1755 MHz") and "sw_power_cap 100%" in clocks.summary()


class _Props:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_smi_id_names_the_board_by_its_pci_bus_id(monkeypatch):
    # CUDA's index 1 under CUDA_VISIBLE_DEVICES may be NVML's board 5: the bus id names the same board for both
    import torch
    asked = []

    def props(index):
        asked.append(index)
        return _Props(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0, name="GPU")

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert gpu_clocks.smi_id() == "00000000:1b:00.0" and asked == [1]
    assert gpu_clocks.smi_id(3) == "00000000:1b:00.0" and asked == [1, 3]
    # a torch that does not report the bus: the CUDA index, as before
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props(name="GPU"))
    assert gpu_clocks.smi_id() == "1"


def test_sampler_queries_the_board_it_is_given(tmp_path):
    smi = _fake_smi(tmp_path, f'echo "$*" >> {tmp_path}/args\necho "1, 1, 1, 0x0"\n')
    with gpu_clocks.ClockSampler(command=smi, index="00000000:1b:00.0"):
        pass
    assert "--id=00000000:1b:00.0" in (tmp_path / "args").read_text().splitlines()[0]
