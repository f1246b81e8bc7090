"""How one run is set up, split, probed, launched and bounded: the processes and devices of training.

    batch_split.py    RunFab's batch contract: microbatch x accumulation x ranks rows make one update
    probe.py          RunFab's memory probe: the real model and optimizer on worst-case rows, every device
    training_run.py   one run on stdin, as a list of steps: output folder, encoder, input, fit, export
    shard_run.py      one run from prepared shards (data.source litdata), on one node or several
    update_agreement.py  what the ranks of that run settle once per update, in one all-reduce
    launcher.py       data parallelism with the feeder owning stdin: one worker process per device
    worker.py         one of those workers: ``python train.py worker``
    torchrun.py       ``python -m runtime.torchrun``: torchrun, ending a stop without a traceback
    trainer.py        the Lightning Trainer, built in one place for training and the probe
    device_policy.py  devices and ranks, precision, the data-parallel strategy, GPU memory, the compiler
    host_budget.py    the host memory a run will need against the job's budget (or a CPU run's free memory)
    output_folder.py  the output folder's layout, held by one run at a time, checked for room
    checkpoints.py    how checkpoints are written and chosen, and what a resume must keep

Not RunFab's facts (limits, what ships, how a process ends: runfab/), the stream of records (pipeline/)
or the Lightning callbacks (callbacks/). May import ``model``, ``pipeline``, ``callbacks``, ``runfab`` and
the root modules (config, lit_module, datamodule).
"""
