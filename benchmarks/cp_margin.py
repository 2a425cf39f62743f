"""The ring's SM margin (issue 50): attngen's plain causal ring at each policy.context_parallel.SM_MARGIN value
(the first run again last) against torch's context_parallel over cuDNN, in one process, B=1 H=32 d=128 bf16; the
bench's runner and timer (benchmarks/context_parallel.py). Environment: LENGTHS (default 131072,262144,524288),
MARGINS (0,8,16), REPS (5).

    torchrun --nproc-per-node 4 benchmarks/cp_margin.py
    LENGTHS=524288 MARGINS=0 REPS=3 torchrun --nproc-per-node 2 benchmarks/cp_margin.py
"""
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
import context_parallel as cpb
from attngen.policy import context_parallel as pol
from attngen.distributed import shard_sequence

world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
mesh = init_device_mesh("cuda", (world,))
lengths = [int(x) for x in os.environ.get("LENGTHS", "131072,262144,524288").split(",")]
margins = [int(x) for x in os.environ.get("MARGINS", "0,8,16").split(",")]
reps = int(os.environ.get("REPS", "5"))
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
        for m in margins + margins[:1]:
            pol.SM_MARGIN = m
            f = cpb.timed(lambda: fn(q, k, v), reps, world)
            b = cpb.timed(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), reps, world)
            res[f"attngen m={m}" + ("'" if f"attngen m={m}" in res else "")] = (f, b)
    pol.SM_MARGIN = 0
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
        line = (f"  {world} {n:>7} {name:>13} fwd {f:8.2f} ms {ff / f / 1e9:6.0f} TF x{cf / f:5.3f} | "
                f"f+b {b:8.2f} ms {fb / b / 1e9:6.0f} TF x{cb / b:5.3f}")
        lines.append(line)
        if rank == 0:
            print(line, flush=True)
if rank == 0:
    print("\nTABLE")
    print("\n".join(lines))
dist.destroy_process_group()
