"""How the tests are laid out; what they share (the bundle root, the one tiny configuration) is in
tests/helpers.py.

The tests are grouped by what they exercise: ``unit/`` (one module at a time, in process),
``integration/`` (whole training runs: end to end, faults, the launcher, observation), ``tools/``
(``python -m tools``: packaging, the contract check, emulation, the report, the benchmarks, the data
tools) and ``gpu/`` (skipped without CUDA).
"""


import os

# One intra-op thread in every process of the suite (this one and the train.py processes it starts): the two test
# workers already fill the two cores, and PyTorch's OpenMP threads on top of them wait for each other (the
# integration tests ran 16 % faster). A value set outside the suite is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
