"""Run a script (argv[1], its arguments after) with accelerate's FSDP and DeepSpeed paths enabled on CPU processes
(`trl_setup.accelerate_fsdp_on_cpu`, `accelerate_deepspeed_on_cpu`): how the tests run the examples over gloo. Then,
on Linux, print how many of the process's threads are gloo's: a script that ended its process group (the examples'
`end_process_group`) leaves none to end in the interpreter's teardown."""

from __future__ import annotations

import os
import runpy
import sys

from trl_setup import accelerate_deepspeed_on_cpu, accelerate_fsdp_on_cpu

if __name__ == "__main__":
    accelerate_fsdp_on_cpu()
    accelerate_deepspeed_on_cpu()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    if os.path.isdir("/proc/self/task"):
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        print(f"gloo threads left: {sum('gloo' in n for n in names)}", flush=True)
