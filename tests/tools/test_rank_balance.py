"""tools/rank_balance.py: the attention-work balance of data-parallel ranks, measured without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import ROOT


def test_balancing_evens_out_the_ranks_attention_work_on_realistic_documents():
    records = subprocess.run([sys.executable, "-m", "tools.synthetic_records", "--docs", "2500"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    result = subprocess.run([sys.executable, "-m", "tools.rank_balance"], input=records, cwd=ROOT,
                            capture_output=True, check=True, timeout=120)
    found = re.search(rb"stream order ([0-9.]+), balanced ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    in_order, balanced = float(found[1]), float(found[2])
    assert 1.0 <= balanced < 1.01 and balanced < in_order  # the busiest rank within 1 % of the mean
