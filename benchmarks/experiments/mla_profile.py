"""Nsight Compute's target for the Gluon MLA decode kernel: 128 heads, batch 64 x 8k keys in pages of 64, 1 split, the
policy's schedule, one launch inside the NVTX range "profile/mla128" (warmed up before it). GPU only.

    ncu --nvtx --nvtx-include "profile/" --clock-control none --set detailed --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --import-source no --csv --page raw \
        python benchmarks/experiments/mla_profile.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import mla_sweep  # noqa: E402

kernel, name = mla_sweep.load_gluon()
tuner, inputs, default, _ = mla_sweep._setup(kernel, 128, 64, 8192, "cuda")
config = dict(default, num_splits=1, warp_specialized=1)
for _ in range(3):
    tuner.tuning_run(inputs, config)
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("profile")
torch.cuda.nvtx.range_push("mla128")
tuner.tuning_run(inputs, config)
torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
torch.cuda.nvtx.range_pop()
print(f"profiled the {name} schedule")
