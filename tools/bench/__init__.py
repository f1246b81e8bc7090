"""Measurements: ``python -m tools bench NAME [ARGS]``, one experiment a name (``--help`` lists them).
Never shipped, and not a test: an experiment measures, the tests under tests/ check.

    training.py           the trainer's experiments on a GPU, one function each; runs.py, what they share
    host_pipeline.py      the data pipeline alone, on the CPU
    gpu_clocks.py         the SM clock and power a run ran at (nvidia-smi beside it), for runs.py
    allreduce.py          all-reduce bandwidth between this machine's GPUs
    trace_summary.py      where the GPU time of a profiled window went
    rank_balance.py       how evenly data-parallel ranks share attention work
    shards.py             one rank reading prepared shards (data.source litdata) on one core
    time_to_loss.py       candidate recipes against the reference: training seconds to its final validation loss
    synthetic_records.py  NDJSON records of random tokens with heavy-tailed lengths, the experiments' input
    llama_speed.sh        the Llama preset against GPT-2's in one job (trainer, Llama variants), then a Llama trace
    time_to_loss_sweep.sh conf/fast-150m.yaml's candidate ingredients, one at a time, in time-to-loss jobs

May import the training modules and tools.processes. The trainer experiments and host-pipeline take
the configuration as train.py does: ``--config FILE`` and ``--section.key VALUE``.
"""

from __future__ import annotations

from tools import dispatch

# name -> ("module:function" run with the remaining arguments, the line --help shows for it)
EXPERIMENTS = {
    "trainer": ("tools.bench.training:trainer", "train.py against the same work in a plain PyTorch loop (GPU)"),
    "observe": ("tools.bench.training:observe", "a run with a profiler window and a memory snapshot against one without (GPU)"),
    "reference": ("tools.bench.training:reference", "train.py against nanoGPT's recipe on one-document rows (GPU)"),
    "workers": ("tools.bench.training:workers", "the data-parallel worker path against one process: speed, host memory (GPU)"),
    "scaling": ("tools.bench.training:scaling", "train.py on 1 GPU against 2, the same microbatch per GPU (GPUs)"),
    "probe-timing": ("tools.bench.training:probe_timing", "RunFab's probe of one microbatch: seconds, host memory (GPU)"),
    "memory-sweep": ("tools.bench.training:memory_sweep", "the probe's peak GPU memory, eager against compiled (GPU)"),
    "host-pipeline": ("tools.bench.host_pipeline", "the data pipeline alone, stdin to updates: tokens/s (CPU)"),
    "allreduce": ("tools.bench.allreduce", "all-reduce of the gradients' size between this machine's GPUs (2+ GPUs)"),
    "trace-summary": ("tools.bench.trace_summary", "where the GPU time of a profiled window went (a trace file)"),
    "rank-balance": ("tools.bench.rank_balance", "how evenly data-parallel ranks share attention work (CPU)"),
    "shards": ("tools.bench.shards", "one rank reading prepared shards on one core, against a GPU's consumption (CPU)"),
    "time-to-loss": ("tools.bench.time_to_loss", "GPU-seconds of candidate recipes to the reference's final validation "
                     "loss, on real text (GPU)"),
    "synthetic-records": ("tools.bench.synthetic_records", "NDJSON records of random tokens, heavy-tailed lengths"),
}


def main(argv: list[str]) -> int:
    return dispatch("python -m tools bench", EXPERIMENTS, argv)
