"""Peak-memory measurement as docs/design.md §5 defines it.

CPU: the high-water RSS (VmHWM), reset to the current RSS via /proc/self/clear_refs before the region (Linux >= 4.0),
minus the RSS before it. CUDA: `torch.cuda.max_memory_allocated` after a reset, minus what was allocated before."""

from __future__ import annotations

import torch

from longstraw.planner import MIB


def proc_status_bytes(name: str) -> int | None:
    """A `kB` line of /proc/self/status (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_cpu_peak() -> bool:
    """Reset VmHWM to the current RSS; False when the kernel or sandbox refuses (the peak then includes earlier use)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = proc_status_bytes("VmHWM"), proc_status_bytes("VmRSS")
    # The write can "succeed" on kernels that ignore value 5; only trust it if HWM actually came down to RSS.
    return hwm is not None and rss is not None and hwm <= rss + MIB


class PeakMemory:
    """Measure the peak of a region: `start()` before it, `peak_bytes()` after (bytes above the start)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.base = 0
        self.reset_ok = True

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.reset_ok = reset_cpu_peak()
            self.base = proc_status_bytes("VmRSS") or 0

    def peak_absolute_bytes(self) -> int:
        """The region's peak in absolute terms: VmHWM (whole process RSS) or CUDA max allocated."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return proc_status_bytes("VmHWM") or 0

    def peak_bytes(self) -> int:
        return self.peak_absolute_bytes() - self.base
