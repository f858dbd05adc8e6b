"""Run a script (argv[1], its arguments after) with accelerate's FSDP and DeepSpeed paths enabled on CPU processes
(`trl_setup.accelerate_fsdp_on_cpu`, `accelerate_deepspeed_on_cpu`): how the tests run the examples over gloo."""

from __future__ import annotations

import runpy
import sys

from trl_setup import accelerate_deepspeed_on_cpu, accelerate_fsdp_on_cpu

if __name__ == "__main__":
    accelerate_fsdp_on_cpu()
    accelerate_deepspeed_on_cpu()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
