#!/usr/bin/env python3
"""NCCL's own all-reduce figures for the message sizes of `nccl_all_reduce_bench`
(hidden 4096 in bf16 × tokens), through torch.distributed on every visible GPU: the
reference our communicator is measured against. NVLink multicast stays off.

  NCCL_NVLS_ENABLE=0 python3 scripts/allreduce_torch.py
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096
TOKENS = [1, 8, 32, 128, 256, 1024, 4096]


def run(rank, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 500 if tokens <= 256 else 100
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        secs = torch.tensor([(time.perf_counter() - t) / iters], device="cuda")
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)
        if rank == 0:
            nbytes = tokens * HIDDEN * 2
            busbw = nbytes * 2 * (world - 1) / world / secs.item() / 1e9
            print(f"BENCH torch-allreduce ranks={world} tokens={tokens} bytes={nbytes} "
                  f"time={secs.item() * 1e6:.2f}us busbw={busbw:.1f}GB/s "
                  f"(nccl {'.'.join(map(str, torch.cuda.nccl.version()))})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = torch.cuda.device_count()
    mp.spawn(run, args=(world,), nprocs=world)
