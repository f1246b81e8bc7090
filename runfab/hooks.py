"""The contract's interface: what RunFab looks up in ``train.py`` and calls, written once.

The bundle's checks (tools/bundle/static_checks.py) and the sandbox that calls the hooks as RunFab does
(tools/bundle/sandbox.py) both read these; ``train.py`` defines them.
"""

BATCH_NAME = "EFFECTIVE_BATCH_SIZE"  # a module-level integer literal in train.py
BATCH_MIN, BATCH_MAX = 1, 65536
HOOKS = {"probe_batch": ["microbatch"], "train": ["microbatch", "accumulation"]}  # function -> its parameters
