"""What proves a bundle before it is uploaded. Never shipped in it, and not the rule of what ships
(runfab/shipping.py, which training imports too).

    package.py        the upload ZIP: runfab.shipping's files, refused when it would break the contract
    check.py          the contract check, driven from here:
      static_checks.py    what reading the bundle tells (layout, sizes, the batch literal, the hooks)
      sandbox.py          where the bundle runs: a read-only copy, empty folders, one fresh child each
      child.py            what runs inside that child (standard library only, loaded by path)
      judge.py            verdicts on what the import and the probe did
    emulate.py        RunFab's procedure on this machine: probe each candidate, then train under the budgets

May import the training modules (runtime, config, ...), tools.processes and tools.report; child.py
imports nothing of this project, since it runs inside the bundle's interpreter.
"""
