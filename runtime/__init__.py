"""Processes, devices and the platform: how one run is set up, split, probed, launched and bounded.

The batch split, the memory probe, one training run, the launcher of data-parallel workers, device
and precision policy, host memory as RunFab charges it, RunFab's limits, what ships, and how a
process ends (stop signals, parent death). May import
``model``, ``pipeline``, the root modules (config, lit_module, datamodule) and ``callbacks``.
"""
