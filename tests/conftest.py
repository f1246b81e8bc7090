"""How the tests are laid out; what they share (the bundle root, the one tiny configuration) is in
tests/helpers.py.

The tests are grouped by what they exercise: ``unit/`` (one module at a time, in process),
``integration/`` (whole training runs: end to end, faults, the launcher, observation), ``tools/``
(``python -m tools``: packaging, the contract check, emulation, the report, the benchmarks, the data
tools) and ``gpu/`` (skipped without CUDA).
"""

