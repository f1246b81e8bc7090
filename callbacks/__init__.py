"""The Lightning callbacks of a run, one a file: what a run does at the Trainer's hooks.

    runfab_metrics.py     RunFab's graph feed: one JSON line on stdout every few seconds and at the end
    progress.py           the progress bar, on stderr, in optimizer updates
    fixed_validation.py   the validation cross-entropy of the initial and the final weights
    history.py            the per-update history and the digests that make two runs comparable
    observe.py            observation windows: a profiler trace and a CUDA allocator history
    memory_stages.py      the host memory of a run, stage by stage (runfab/process_memory.py reads it)
    export.py             the trained model as a Hugging Face checkpoint of its family (safetensors)
    run_record.py         the run record: what ran, where, on which data and settings, and what came of it
    resume_fingerprint.py what a resume must not change, stored in every checkpoint
    stop_checkpoint.py    the checkpoint a run on stdin writes when a signal ends it early
    graceful_stop.py      a stop signal during training: finish the update, keep what was trained
    agreed_stop.py        the stop of a run from shards, agreed by every rank at one update
    owned_folders.py      (not a callback) the mark on the folders a run writes, which the export and the output
                          folder read

Not the run's steps, its processes or its output layout (runtime/), and not a utility other packages
share (that lives on the floor below its users: pipeline/, runfab/). May import ``model``, ``pipeline``
and ``runfab``; never ``runtime`` or ``config``.
"""
