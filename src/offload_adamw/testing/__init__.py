"""Test devices for offload-adamw's own tests (as torch keeps such things in ``torch.testing._internal``).

No module of the library imports this package: a test installs what it needs (accel/streams.py's registration),
and the library asks the installed backend, never this package.
"""
