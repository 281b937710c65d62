"""``offload-adamw selftest``'s work: on this machine, does OffloadAdamW compute what it promises, and how fast?

Contract: :mod:`.environment` reports what the machine offers (versions, GPUs and their NUMA nodes, host memory,
the locked-memory limit, cores, page-locking); :mod:`.parity` runs the parity table, every placement and mode of
the optimizer against ``torch.optim.AdamW(fused=True)`` on float32 masters, bitwise, on the device asked for;
:mod:`.bench` measures (``--bench``). The command line (:mod:`offload_adamw.cli.selftest`) prints and writes them.
"""
