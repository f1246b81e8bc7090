"""RunFab's numbers, from the training contract, written once.

Training reads them as defaults (config.py, the metric line check) and the tools in ``tools/``
check bundles and runs against them; nothing else spells these figures out.
"""

MIB = 1 << 20
GIB = 1 << 30

ZIP_BYTES = 16 * MIB  # the uploaded code ZIP
EXPANDED_BYTES = 64 * MIB  # what the ZIP unpacks to
PROBE_SECONDS = 120.0  # one probe subprocess, interpreter start and `import train` included
CPU_CORES = 2
RAM_BYTES = 8 * GIB  # the job's host memory; scratch and output are charged to it too
TMP_BYTES = 256 * MIB  # /tmp
OUTPUT_BYTES = 3 * GIB  # everything under RUNFABRIC_OUTPUT, RAM-backed
RECORD_BYTES = 1 * MIB  # one streamed stdin record
METRIC_LINE_CHARS = 8192  # a metric line must stay below this many characters
