"""why the forward-only ring timing is 12-15% slower than the forward inside forward+backward (4 GPUs)"""
import os, sys, statistics
sys.path.insert(0, "benchmarks")
import torch, torch.distributed as dist
import context_parallel as B
from attngen.distributed import shard_sequence, timeline
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
n = int(sys.argv[1])
_, fn = B.runner("attngen", world, 4096, 30.0, None)
torch.manual_seed(0)
full = [torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
q, k, v = (shard_sequence(t, world, rank, load_balance=True).contiguous().requires_grad_() for t in full)
del full
do = torch.randn_like(q)
def per_rep(f, reps):
    f(); out = []
    for _ in range(reps):
        dist.barrier(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); torch.cuda.synchronize()
        ms = torch.tensor(s.elapsed_time(e), device="cuda"); dist.all_reduce(ms, op=dist.ReduceOp.MAX); out.append(round(ms.item(), 1))
    return out
fwd = lambda: fn(q, k, v)
both = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)
def keep():
    global kept
    kept = fn(q, k, v)
def nograd():
    with torch.no_grad():
        fn(q, k, v)
res = {}
res["fwd1"] = per_rep(fwd, 4)
res["both"] = per_rep(both, 3)
res["fwd2"] = per_rep(fwd, 4)
res["fwd_keep_out"] = per_rep(keep, 4)
res["fwd_no_grad"] = per_rep(nograd, 4)
dist.barrier(); torch.cuda.synchronize()
with timeline() as rec:
    fn(q, k, v)
torch.cuda.synchronize()
every = [None] * world
dist.all_gather_object(every, rec.rows())
if rank == 0:
    print(B.step_table([{"rank": r, **row} for r, rows in enumerate(every) for row in rows]))
    for key, val in res.items():
        print(f"{n} {key:14} {val} median {statistics.median(val)}")
dist.destroy_process_group()
