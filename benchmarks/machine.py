"""`machine_info()`: the host a benchmark ran on (CPU, cores, memory, library versions).

Ratios measured in one run are comparable across machines; absolute numbers are not, so each result file
carries enough to tell which machine produced it. Hostnames are deliberately left out.
"""

from __future__ import annotations

import os
import platform


def _cpu_model() -> str:
    """The `model name` line of /proc/cpuinfo (Linux); platform.processor() elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _total_memory_bytes() -> int | None:
    """MemTotal from /proc/meminfo, or sysconf where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def _usable_cores() -> int | None:
    # The affinity mask, not cpu_count, is what a container or taskset actually lets us run on.
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def machine_info(device: str = "cpu") -> dict[str, object]:
    """CPU model, core counts, total memory, torch/transformers/python versions and the benchmark device."""
    import torch
    import transformers

    info: dict[str, object] = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": _usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": _total_memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        # Other processes competing for the cores make step times (not peaks) noisy; this shows whether they were.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        # OpenMP's wait policy the workers inherit (read by libgomp when torch loads; the `longstraw` command sets
        # PASSIVE unless the user set it: cli.passive_openmp_wait). It changes times on a busy host, not peaks.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        info.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info
