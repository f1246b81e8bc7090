"""How fast the GPUs of this machine all-reduce the reference model's gradients, and over which link.

One process per visible GPU (NCCL, as training uses it) all-reduces a buffer the size of the
gradients of the 126,716,160-parameter model, in fp32 (what DDP sends) and in bf16, and prints the
median time and the bus bandwidth (NCCL's convention: 2 (n-1)/n bytes per byte all-reduced).
Run with NCCL_DEBUG=INFO to see the transport NCCL chose (P2P/CUMEM, SHM or NET).

Usage: python -m tools bench allreduce [--parameters 126716160] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runfab.limits import MIB


def worker(rank: int, world: int, port: int, parameters: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    for dtype in (torch.float32, torch.bfloat16):
        buffer = torch.randn(parameters, device="cuda").to(dtype)
        times = []
        for i in range(repeats + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            dist.all_reduce(buffer)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end) / 1e3)
        seconds = statistics.median(times)
        size = buffer.numel() * buffer.element_size()
        if rank == 0:
            bus = 2 * (world - 1) / world * size / seconds / 1e9
            print(f"all-reduce {size / MIB:.0f} MiB {str(dtype).removeprefix('torch.')} over {world} GPUs: "
                  f"{seconds * 1e3:.2f} ms median, bus bandwidth {bus:.1f} GB/s", flush=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools bench allreduce", description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=126_716_160,
                        help="values all-reduced (default: the reference model's parameter count)")
    parser.add_argument("--repeats", type=int, default=20, help="timed all-reduces per dtype (default: 20)")
    args = parser.parse_args(argv)
    world = torch.cuda.device_count()
    if world < 2:
        print(f"python -m tools bench allreduce: needs 2 or more CUDA GPUs; this machine has {world}", file=sys.stderr)
        return 2
    mp.spawn(worker, args=(world, 29511, args.parameters, args.repeats), nprocs=world)
    return 0
