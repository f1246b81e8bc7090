"""Shared fixtures: the bundle root and a tiny configuration that trains in seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def root() -> Path:
    return ROOT
