"""The ring's high-priority exchanges (issue 50): attngen's plain causal ring with
policy.context_parallel.HIGH_PRIORITY_EXCHANGES off, on, off again, then on again, against torch's context_parallel
over cuDNN, in one process, B=1 H=32 d=128 bf16; the bench's runner and timer (benchmarks/context_parallel.py).
Run it with and without TORCH_NCCL_HIGH_PRIORITY=1 (every NCCL stream of the process high priority: cuDNN's too).
Environment: LENGTHS (default 131072,524288), REPS (5).

    torchrun --nproc-per-node 2 benchmarks/cp_priority.py
    TORCH_NCCL_HIGH_PRIORITY=1 torchrun --nproc-per-node 2 benchmarks/cp_priority.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402

import context_parallel as cpb  # noqa: E402
from attngen.distributed import shard_sequence  # noqa: E402
from attngen.policy import context_parallel as pol  # noqa: E402

world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
mesh = init_device_mesh("cuda", (world,))
lengths = [int(x) for x in os.environ.get("LENGTHS", "131072,524288").split(",")]
reps = int(os.environ.get("REPS", "5"))
env = os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "0")
H, D = 32, 128
lines = []
for n in lengths:
    torch.manual_seed(0)
    full = [torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    res = {}
    context, fn = cpb.runner("attngen", world, 4096, 30.0, None)
    shards = [shard_sequence(t, world, rank, load_balance=True).contiguous() for t in full]
    q, k, v = (t.detach().requires_grad_() for t in shards)
    do = torch.randn_like(q)
    with context:
        for i, on in enumerate((False, True, False, True)):
            pol.HIGH_PRIORITY_EXCHANGES = on
            f = cpb.timed(lambda: fn(q, k, v), reps, world)
            b = cpb.timed(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), reps, world)
            res[f"hp={int(on)} #{i // 2}"] = (f, b)
    pol.HIGH_PRIORITY_EXCHANGES = False
    del q, k, v, do, shards
    context, fn = cpb.runner("torch_cudnn", world, 4096, 30.0, None)
    shards = [t.clone() for t in full]
    del full
    cp = context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2])
    with context, cp:
        q, k, v = (t.detach().requires_grad_() for t in shards)
        do = torch.randn_like(q)
        f = cpb.timed(lambda: fn(q, k, v), reps, world)
        b = cpb.timed(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), reps, world)
        res["torch_cudnn"] = (f, b)
    del q, k, v, do, shards
    torch.cuda.empty_cache()
    ff, fb = cpb.flops(n, H, D, None, False), cpb.flops(n, H, D, None, True)
    cf, cb = res["torch_cudnn"]
    for name, (f, b) in res.items():
        line = (f"  env={env} {world} {n:>7} {name:>12} fwd {f:8.2f} ms {ff / f / 1e9:6.0f} TF x{cf / f:5.3f} | "
                f"f+b {b:8.2f} ms {fb / b / 1e9:6.0f} TF x{cb / b:5.3f}")
        lines.append(line)
        if rank == 0:
            print(line, flush=True)
if rank == 0:
    print("\nTABLE")
    print("\n".join(lines))
dist.destroy_process_group()
