"""The ``offload-adamw`` command line: one module per subcommand, each imported only when it runs."""

from offload_adamw.cli.main import SUBCOMMANDS, main

__all__ = ["SUBCOMMANDS", "main"]
