"""How long one conformance check takes, beside the imports that any check of a torch optimizer needs.

    python benchmarks/checker_time.py                 # 3 rounds, interleaved
    python benchmarks/checker_time.py --rounds 5 --json checker_time.json
    python benchmarks/checker_time.py --quick         # one round, a smoke run

Each round runs, one after another in fresh processes (so each pays its own imports):

* ``import torch``, then ``os._exit`` (the check's processes end so too: no teardown of torch);
* ``import torch`` and construct a ``torch.optim.AdamW`` and step it once, which imports torch._dynamo
  (``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo`` and every ``step`` by
  ``_use_grad_for_differentiable``, which import it on their first call): the floor under any check
  whose candidate is a ``torch.optim.Optimizer``;
* ``offload-adamw check CANDIDATE`` (one candidate, wall time of the whole command);
* ``offload-adamw check`` with the candidate given ``--batch`` times: each report's ``seconds``
  after the first is what a candidate costs in a study that checks many in one command.

Printed: the median of each, the single check's time over the floor, and the median per-candidate
time in the batch. Timings on a shared machine are not results: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from offload_adamw._output import json_document, render_table

# Both end with os._exit, as the check's own processes do: the interpreter's teardown of torch is not
# part of the floor (a plain exit adds about 0.3 s here).
IMPORT_TORCH = "import os, torch; os._exit(0)"
FLOOR = ("import os, torch; p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.ones(2); "
         "torch.optim.AdamW([p]).step(); os._exit(0)")


def _wall(argv: list[str]) -> tuple[float, str]:
    """Seconds ``argv`` takes from start to exit, and its stdout; a failure other than exit 1 stops the run."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"})
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} ended with {done.returncode}:\n{done.stderr}")
    return seconds, done.stdout


def _check_command() -> list[str]:
    return [sys.executable, "-m", "offload_adamw", "check", "--no-progress"]


def run(candidate: str, rounds: int, batch: int) -> dict[str, object]:
    """The figures of ``rounds`` interleaved rounds (see the module docstring)."""
    samples: dict[str, list[float]] = {"import_torch": [], "floor": [], "one_check": [], "batch_per_candidate": []}
    for _ in range(rounds):
        samples["import_torch"].append(_wall([sys.executable, "-c", IMPORT_TORCH])[0])
        samples["floor"].append(_wall([sys.executable, "-c", FLOOR])[0])
        samples["one_check"].append(_wall([*_check_command(), candidate])[0])
        _, out = _wall([*_check_command(), *[candidate] * batch, "--json", "-"])
        reports = json.loads(out)["reports"]
        samples["batch_per_candidate"].extend(r["seconds"] for r in reports[1:])
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {"candidate": candidate, "rounds": rounds, "batch": batch, "samples": samples, "medians": medians,
            "over_floor": medians["one_check"] - medians["floor"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="checker_time.py", description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", default="torch.optim:AdamW", help="the optimizer checked (default: torch's AdamW)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--batch", type=int, default=4, help="candidates in the batched command (default 4)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="one round, a batch of 2 (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch = 1, 2
    if args.rounds < 1 or args.batch < 2:
        parser.error("--rounds must be at least 1 and --batch at least 2")
    result = run(args.candidate, args.rounds, args.batch)
    medians = result["medians"]
    assert isinstance(medians, dict)
    rows = [
        ["import torch (then os._exit, as every check process ends)", f"{medians['import_torch']:.2f}"],
        ["the same, building and stepping a torch.optim.AdamW (imports torch._dynamo)", f"{medians['floor']:.2f}"],
        [f"offload-adamw check {args.candidate}", f"{medians['one_check']:.2f}"],
        ["  of which over the line above", f"{result['over_floor']:.2f}"],
        [f"one more candidate in a command that checks {args.batch}", f"{medians['batch_per_candidate']:.2f}"],
    ]
    print(f"{args.rounds} round(s), medians, seconds of wall time")
    print(render_table(["what", "seconds"], rows, align="lr"))
    if args.json:
        Path(args.json).write_text(json.dumps(json_document("checker_time", result), indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
