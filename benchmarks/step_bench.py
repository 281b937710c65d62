"""The host AdamW step benchmark; the same command as `offload-adamw bench`.

    python benchmarks/step_bench.py --sizes 16M,64M,256M --repeats 7 --json step.json --plot step.png

See offload_adamw/cli/bench.py for what is measured and how.
"""

import argparse
import sys

from offload_adamw.cli import bench as bench_cli


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="step_bench.py", description=bench_cli.__doc__.splitlines()[0])
    bench_cli.add_arguments(parser)
    return bench_cli.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
