"""The ground floor: what the RunFab platform is and does, written once, importing nothing of the project.

limits.py         the contract's numbers (bundle sizes, probe time, cores, host memory, /tmp, output, records)
hooks.py          the contract's interface: the batch-size name and the hooks train.py defines
lifetime.py       how a process ends: the one installer of SIGTERM/SIGINT handlers, and ending with its parent
shipping.py       which files make up the upload bundle
created_files.py  creating a file without following a link someone planted where it goes
library_import.py importing Lightning in a hook's process without leaving what the import writes
process_memory.py a process's (or a process tree's) memory as RunFab's memory cgroup charges it, stage by stage

Training, the pipeline, the callbacks and the tools import these; these import only the standard library.
Not runtime/ (beside it in ``ls``): that is how a run uses the platform (processes, devices, the output
folder), and it imports these.
"""
