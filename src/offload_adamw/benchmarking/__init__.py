"""Measurements of this machine and of the optimizer on it: the host bandwidth probe, the host-step and overlap
benchmarks, and the pieces the GPU run shares with them. The modules are imported by name (each states what it
needs; some need no torch), so this package imports nothing itself."""
