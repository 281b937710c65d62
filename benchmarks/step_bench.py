"""The host AdamW step benchmark; the same command as `offload-adamw bench`.

    python benchmarks/step_bench.py --sizes 16M,64M,256M --repeats 7 --json step.json --plot step.png

See offload_adamw/benchmarking/host_step.py for what is measured and how.
"""

import argparse
import sys

from offload_adamw.cli import bench as bench_cli
from offload_adamw.cli import common


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="step_bench.py", description=bench_cli.__doc__.splitlines()[0])
    bench_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    try:  # the command line's one error path: a usage error is one line and exit status 2, before any work
        common.check_outputs(parser, args)
        return bench_cli.run(args)
    except common.UsageError as exc:
        print(f"step_bench.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
