"""Where the GPU time of a profiled window went: kernel time by family and the top kernels.

Reads a Chrome trace written by the observation window (run/profile/trace-updates-A-B.json) and
prints GPU busy time against the window's span, kernel time grouped into families (matrix
products, attention, compiled fused kernels, optimizer, copies) and the heaviest kernels. With
--by-shape, also the matrix products by the operator that launched them and its input shapes (the
window records shapes), with their time per call and TFLOP/s: which products fall short of the rest.

Usage: python -m tools bench trace-summary OUTPUT/run/profile/trace-updates-15-16.json [--top 25] [--by-shape]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

FAMILIES = (  # first match wins; names are lower-cased
    ("communication (nccl)", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "matmul")),
    ("optimizer", ("multi_tensor", "adam", "foreach", "norm_kernel")),
    ("loss softmax (triton)", ("_loss_and_gradient_rows",)),  # model/kernels/triton_cross_entropy.py
    ("compiled (triton)", ("triton",)),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
)


PHASES = ("zero_grad", "forward", "backward", "optimizer_step")


def family(name: str) -> str:
    lowered = name.lower()
    for label, needles in FAMILIES:
        if any(n in lowered for n in needles):
            return label
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def summarize(trace: dict, top: int) -> str:
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and "dur" in e]
    if not kernels:
        return "no GPU kernels in this trace (a CPU run?)"
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = busy_time(intervals)
    by_family, by_name, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in kernels:
        by_family[family(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        counts[e["name"]] += 1
    total = sum(by_family.values())
    lines = [f"window {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({busy / span:.1%}), "
             f"{len(kernels)} kernels, kernel time {total / 1e3:.1f} ms"]
    communication = [iv for iv, e in zip(intervals, kernels) if family(e["name"]).startswith("communication")]
    if communication:  # data parallelism: how much of the all-reduce time no computation hides
        compute = [iv for iv, e in zip(intervals, kernels) if not family(e["name"]).startswith("communication")]
        comm_busy, compute_busy = busy_time(communication), busy_time(compute)
        exposed = busy - compute_busy
        lines.append(f"communication {comm_busy / 1e3:.1f} ms, of which exposed (no compute kernel beside it) "
                     f"{exposed / 1e3:.1f} ms; computation {compute_busy / 1e3:.1f} ms; "
                     f"GPU idle {(span - busy) / 1e3:.1f} ms")
    phases = defaultdict(float)
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "user_annotation" and "dur" in e and e.get("name") in PHASES:
            phases[e["name"]] += e["dur"]
    if phases:
        lines.append("host time in the phases (CPU, record_function): " + ", ".join(
            f"{name} {phases[name] / 1e3:.1f} ms" for name in PHASES if name in phases))
    for label, us in sorted(by_family.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:<20} {us / 1e3:9.1f} ms  {us / total:6.1%}")
    lines.append(f"top {top} kernels:")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / 1e3:9.1f} ms {us / total:6.1%} x{counts[name]:<5} {family(name):<18} {name[:110]}")
    return "\n".join(lines)


def launching_ops(events: list[dict]) -> dict:
    """Correlation id of each kernel launch -> the innermost operator with input shapes that was open
    on the launching thread (the profiler nests operators by time on each thread)."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph", "X") != "X" or "dur" not in e:
            continue
        if e.get("cat") == "cpu_op" or (e.get("cat") in ("cuda_runtime", "cuda_driver")
                                         and "correlation" in e.get("args", {})):
            by_thread[e.get("tid")].append(e)
    owners = {}
    for timeline in by_thread.values():
        # at equal start the longer event opens first, and an operator before a launch starting with it
        timeline.sort(key=lambda e: (e["ts"], -e["dur"], e.get("cat") != "cpu_op"))
        open_ops: list[dict] = []
        for e in timeline:
            while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] <= e["ts"]:
                open_ops.pop()
            if e.get("cat") == "cpu_op":
                open_ops.append(e)
                continue
            owners[e["args"]["correlation"]] = next(
                (op for op in reversed(open_ops) if op.get("args", {}).get("Input Dims")), None)
    return owners


def product_flops(dims: list) -> int | None:
    """2*m*k*n for the first two 2-D inputs that multiply ([m, k] then [k, n]): an addmm's bias and an
    out= buffer are passed over; None when no such pair is there."""
    matrices = [d for d in dims if isinstance(d, list) and len(d) == 2]
    for (m, k), (k2, n) in zip(matrices, matrices[1:]):
        if k == k2:
            return 2 * m * k * n
    return None


def products_by_shape(trace: dict, top: int) -> str:
    events = trace.get("traceEvents", [])
    owners = launching_ops(events)
    rows = defaultdict(lambda: [0.0, 0])  # (operator, shapes) -> [kernel us, kernels]
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e or family(e["name"]) != "matmul":
            continue
        op = owners.get(e.get("args", {}).get("correlation"))
        key = (op["name"], json.dumps(op["args"]["Input Dims"])) if op else ("(no operator with shapes)", "[]")
        rows[key][0] += e["dur"]
        rows[key][1] += 1
    if not rows:
        return "no matrix-product kernels in this trace"
    lines = [f"matrix products by operator and input shapes ({sum(r[0] for r in rows.values()) / 1e3:.1f} ms):"]
    for (name, dims), (us, calls) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        flops = product_flops(json.loads(dims))
        rate = f"{flops * calls / us / 1e6:5.0f} TFLOP/s" if flops else "       -      "
        lines.append(f"  {us / 1e3:8.1f} ms x{calls:<4} {us / calls / 1e3:7.3f} ms a call {rate}  {name} {dims[:100]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools bench trace-summary", description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a Chrome trace from the observation window (run/profile/...)")
    parser.add_argument("--top", type=int, default=25, help="heaviest kernels listed (default: 25)")
    parser.add_argument("--by-shape", action="store_true",
                        help="also the matrix products by launching operator and input shapes, with TFLOP/s")
    args = parser.parse_args(argv)
    trace = json.loads(args.trace.read_text())
    print(summarize(trace, args.top))
    if args.by_shape:
        print(products_by_shape(trace, args.top))
    return 0
