"""``python -m runtime.torchrun [torchrun's options] train.py ...``: torchrun, ending a stop without a traceback.

torchrun (``torch.distributed.run``) passes a SIGTERM or SIGINT on to every rank, waits for them
(``--shutdown-timeout``) and then ends by raising its own ``SignalException``: a traceback and status 1,
whatever the ranks did. This runs the very same torchrun, and when a signal stopped it, says so in one
line and exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a stopped
process does. Each rank has said on its own line where it stopped (docs/several-nodes.md). Any other
end, a rank's failure included, is torchrun's own.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        print(f"torchrun: stopped by {name}; the ranks' lines above say where each stopped (a run from prepared "
              "shards resumes with the same command and --ckpt_path last)", file=sys.stderr)
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
