"""Shared fixtures: the bundle root and the one tiny configuration (defined in tests/helpers.py).

The tests are grouped by what they exercise: ``unit/`` (one module at a time, in process),
``integration/`` (whole training runs: end to end, faults, the launcher, observation), ``tools/``
(``python -m tools``: packaging, the contract check, emulation, the report, the benchmarks, the data
tools) and ``gpu/`` (skipped without CUDA).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ROOT, tiny


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def tiny_config() -> dict[str, object]:
    """A fresh copy of the tiny configuration (dotted keys), for a test to extend."""
    return tiny()
