"""``offload-adamw check``: the conformance checker on the command line.

Contract: prints the report table to stdout, or with ``--json [FILE]`` the report as JSON
(:mod:`offload_adamw.cli.common`: to FILE, or to stdout in place of the table; a top-level
``schema_version``), and returns the exit status: 0 when the candidate conforms
(no clause fails or errs, and the update rule could be compared), 1 when it does not, 2
on a usage error, reported in one line that names the culprit before any clause runs: a
candidate that cannot be loaded (its module raises, calls ``sys.exit``, ends its process
or hangs past ``--timeout`` on import: it is imported in a process of its own, so none of
that reaches this command's status or output), invalid arguments (bad JSON, unknown dtype, unknown
clause, an empty clause list, bad mapping, a ``--timeout`` not above 0 and at most a week), an input
file that is not a regular file of at most 16 MiB (``--batch``, ``--kwargs @FILE``, ``--map @FILE``),
a device that is not there, a ``--json`` path that cannot be written (or takes no write:
``/dev/full``), a ``--setup`` method the optimizer lacks, or a constructor that does not take the
canonical keywords (with the ``--map`` that fits). A ``--json`` file that cannot be written at the
end is exit status 74 and one line.

Several candidates (each with the same options) are checked one after another in one
process, which imports torch once: each report is printed when its check ends, then a
summary with a row per candidate. A candidate that cannot be checked gets its one line on
stderr (naming it) and its row, and the others are still checked; an invalid argument stops
before the first. If the process that runs the checks ends early, the reports before are
kept and the rest are not checked (exit 1). The exit status is 2 when any candidate could
not be checked for a usage reason, else 1 when any does not conform, else 0. With
``--json`` the document holds ``reports`` (each the one-candidate document's fields
below ``schema_version``) and ``not_checked`` (``candidate`` and ``why``).

``--batch FILE`` gives the candidates as a JSON list of entries instead, each with its own
options (keys :data:`BATCH_KEYS`, named as the flags are; a flag gives what an entry leaves
out), so that optimizers with other signatures are checked in one command. A malformed file
or entry is a usage error naming the entry, before anything is checked; an entry whose
options the checker rejects (an unknown dtype) is that entry's usage error, and the others
are still checked.

Examples::

    offload-adamw check torch.optim:AdamW
    offload-adamw check offload_adamw:OffloadAdamW --dtype bf16 --json report.json
    offload-adamw check my_opt.py:MyAdamW --map '{"betas": ["beta1", "beta2"], "eps": "epsilon"}' \\
        --kwargs '{"correct_bias": true}'
    offload-adamw check torch.optim:AdamW torch.optim:Adam my_opt.py:MyAdamW --json study.json
    offload-adamw check --batch study.json   # [{"candidate": "my_opt.py:MyAdamW", "map": {...}}, ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from offload_adamw.cli import common

__all__ = ["add_arguments", "run", "CLAUSE_HELP"]

CLAUSE_HELP = """

Clauses (--dtype D sets the parameter dtype of every clause except where said):
   1  update rule vs. the reference, step 1 and 2-6, plain, amsgrad, maximize; in float64 and in D,
      at the precision the candidate computes in (its state's, or a narrower arithmetic its own
      run shows: clause 8's finding); gradients orthogonal to one weight (projections); without
      eps, against every eps from 1e-30 to 1e-6 (fails where none fits, else n/a)
   2  decoupled weight decay (wd 0 vs. wd > 0 on the same gradients, lr*wd = 0.5; one step from a
      fresh state where the step depends on theta), in D
   3  decay applied to the pre-update value, in D
   4  per-tensor step count, grad None leaves a tensor alone, in D
   5  an explicit zero gradient is an update (vs. the midpoint of tiny ones of both signs), in D
   6  lr = 0: moments absorb the gradient, theta unchanged, in D
   7  parameter groups keep their hyperparameters; an lr change takes effect at its step, in D
   8  state precision: float64, float32, bfloat16 and float16 parameters (whatever D), 64x64 over
      1051 steps, each against the candidate's own widest run; state or arithmetic narrower than
      the parameter (or than float32), the master copy and its round-to-nearest-even narrowing
   9  where the state lives between steps (info; n/a without an accelerator)
  10  state_dict round trip: bitwise continuation, dtypes kept, in D and in bfloat16 (torch's
      global RNG restored at the resume point)
  11  resume into another parameter order matches state by name (or refuses), in D
  12  NaN/negative lr, eps, weight_decay, beta = 1 rejected at construction
  13  non-finite gradients: propagate, skip or raise (judged only against a declared policy), in D
  14  torch.amp.GradScaler's found_inf step leaves no trace, in float32 (float64 for D = fp64)
  15  cost of one step vs. torch.optim.AdamW(fused=True) on 262,144 elements of D (info)

The candidate is imported in a child process and each clause runs in a child of that one,
two at a time, each with a time limit. Several candidates are checked one after another in
one process, which imports torch once (then a summary); --batch FILE lists them with options
of their own. Exit status: 0 conforming, 1 not (a clause fails or errs, or the update rule
could not be compared), 2 usage error (a candidate that cannot be loaded, also one that
exits or hangs on import).
"""


NONFINITE_POLICIES = ("propagate", "skip", "raise")
"""``--nonfinite``'s choices and a batch entry's: contract/rules.py's, written here again because a command
imports only the rooms that run it (tests/test_architecture.py), and a test keeps the two equal."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (parser.description or "") + CLAUSE_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("candidates", nargs="*", metavar="candidate",
                        help="the optimizer: 'package.module:Class' or 'path/to/file.py:Class' (several: each is "
                             "checked with the same options, torch imported once)")
    parser.add_argument("--batch", default=None, metavar="FILE",
                        help="check the candidates a JSON file lists instead, each with its own options: a list of "
                             "entries like {\"candidate\": \"my_opt.py:MyAdamW\", \"map\": {\"eps\": \"epsilon\"}, "
                             "\"dtype\": \"bf16\"} (keys: " + ", ".join(BATCH_KEYS) + "; the flags give what an "
                             "entry leaves out)")
    parser.add_argument("--dtype", default="fp32", help="parameter dtype of the checked run: fp32 (default), bf16, fp16, fp64 "
                                                        "(what it changes per clause: see above)")
    parser.add_argument("--kwargs", default=None, metavar="JSON",
                        help="fixed constructor keyword arguments, e.g. '{\"correct_bias\": true}' (or @file.json)")
    parser.add_argument("--map", dest="mapping", default=None, metavar="JSON",
                        help="canonical hyperparameter -> the candidate's name: lr, betas (one name or two), eps, "
                             "weight_decay, amsgrad, maximize; null = no such argument (eps null: the candidate's own eps; "
                             "clause 1 then fails where no eps from 1e-30 to 1e-6 fits, else is n/a and the check not "
                             "conforming). "
                             "E.g. '{\"betas\": [\"beta1\", \"beta2\"], \"eps\": \"epsilon\"}' (or @file.json)")
    parser.add_argument("--clauses", default=None, metavar="N,N,...", help="run only these clauses (default: all 15)")
    parser.add_argument("--nonfinite", choices=NONFINITE_POLICIES, default=None,
                        help="the declared non-finite policy clause 13 is judged against "
                             "(default: the candidate's 'nonfinite' attribute, else reported only)")
    parser.add_argument("--device", default="cpu", help="device of the parameters (default: cpu)")
    parser.add_argument("--setup", action="append", default=[], metavar="METHOD",
                        help="a method to call on every optimizer built, before it steps (repeatable), e.g. 'train' "
                             "for schedule-free optimizers")
    parser.add_argument("--timeout", default=None, metavar="SECONDS",  # a float, read in _timeout (so errors quote it)
                        help="time limit of importing the candidate and of each clause (default: 120 s, at most a "
                             "week); an "
                             "import that runs longer is a usage error, a clause that does is that clause's error")
    common.add_json_argument(parser, what="the report", dest="json_path")
    common.add_progress_argument(parser)


def _json_argument(flag: str, text: str | None) -> Any:
    if text is None:
        return None
    source = text
    if text.startswith("@"):
        try:
            source = common.read_input(text[1:], flag)
        except common.UsageError as exc:
            raise ValueError(str(exc)) from None
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def _clause_list(where: str, value: Any) -> list[int] | None:
    """``"1,2"`` or ``[1, 2]`` as a list of clause numbers (None: every clause)."""
    if value is None:
        return None
    numbers: list[int] | None = None
    if isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        numbers = list(value)
    elif isinstance(value, str):
        try:
            numbers = [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            pass
    if numbers is None:
        raise ValueError(f"{where}: expected numbers separated by commas, got {value!r}")
    if not numbers:  # running none would report a candidate conforming that nothing was checked of
        raise ValueError(f"{where}: no clause given in {value!r}; name at least one (1-15), or leave it out for all")
    return numbers


MAX_TIMEOUT = 7 * 24 * 3600.0
"""The longest time limit (a week): conformance.checker's, written here again because a command imports only
the rooms that run it (tests/test_architecture.py), and a test keeps the two equal. Waits past about 292
years cannot be expressed to the OS at all."""


def _timeout(where: str, value: Any) -> float:
    """A time limit in seconds (a number, or the flag's text): above 0 and at most :data:`MAX_TIMEOUT` (so never
    NaN or inf); else ValueError quoting ``value`` as given."""
    seconds = value
    if isinstance(value, str):
        try:
            seconds = float(value)
        except ValueError:
            seconds = None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_TIMEOUT:
        raise ValueError(f"{where}: expected a number of seconds above 0 and at most {MAX_TIMEOUT:g} (a week), "
                         f"got {value!r}")
    return float(seconds)


def _flag_options(args: argparse.Namespace) -> dict[str, Any]:
    """The check's keyword arguments from the flags (every candidate's, or each batch entry's defaults)."""
    options: dict[str, Any] = {"dtype": args.dtype, "kwargs": _json_argument("--kwargs", args.kwargs),
                               "mapping": _json_argument("--map", args.mapping),
                               "clauses": _clause_list("--clauses", args.clauses), "nonfinite_policy": args.nonfinite,
                               "device": args.device, "progress": common.progress_wanted(args), "setup": args.setup}
    if args.timeout is not None:
        options["timeout"] = _timeout("--timeout", args.timeout)
    return options


BATCH_KEYS = ("candidate", "dtype", "kwargs", "map", "clauses", "nonfinite", "device", "setup", "timeout")
"""What one entry of a ``--batch`` file may say (the flags of the same names give what it leaves out)."""


def _batch_entries(path: str, defaults: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(candidate, the check's keyword arguments) of each entry of a ``--batch`` file; ValueError names the entry."""
    try:
        entries = json.loads(common.read_input(path, "--batch"))
    except common.UsageError as exc:
        raise ValueError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--batch {path}: not valid JSON ({exc})") from exc
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--batch {path}: expected a non-empty JSON list of entries like "
                         '{"candidate": "torch.optim:AdamW", "dtype": "bf16"}')
    out = []
    for index, entry in enumerate(entries):
        where = f"--batch {path}: entry {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(BATCH_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; an entry may have {', '.join(BATCH_KEYS)}")
        candidate = entry.get("candidate")
        if not isinstance(candidate, str):
            raise ValueError(f"{where}: 'candidate' must be a string like 'package.module:Class', got {candidate!r}")
        options = dict(defaults)
        for key, target in (("kwargs", "kwargs"), ("map", "mapping")):
            if key in entry:
                if not isinstance(entry[key], dict):
                    raise ValueError(f"{where}: {key!r} must be a JSON object, got {entry[key]!r}")
                options[target] = entry[key]
        for key in ("dtype", "device"):
            if key in entry:
                if not isinstance(entry[key], str):
                    raise ValueError(f"{where}: {key!r} must be a string, got {entry[key]!r}")
                options[key] = entry[key]
        if "clauses" in entry:
            options["clauses"] = _clause_list(f"{where}: 'clauses'", entry["clauses"])
        if "nonfinite" in entry:
            if entry["nonfinite"] is not None and entry["nonfinite"] not in NONFINITE_POLICIES:
                raise ValueError(f"{where}: 'nonfinite' must be {', '.join(NONFINITE_POLICIES)} or null, "
                                 f"got {entry['nonfinite']!r}")
            options["nonfinite_policy"] = entry["nonfinite"]
        if "setup" in entry:
            setup = [entry["setup"]] if isinstance(entry["setup"], str) else entry["setup"]
            if not (isinstance(setup, list) and all(isinstance(m, str) for m in setup)):
                raise ValueError(f"{where}: 'setup' must be a method name or a list of them, got {entry['setup']!r}")
            options["setup"] = setup
        if "timeout" in entry:
            options["timeout"] = _timeout(f"{where}: 'timeout'", entry["timeout"])
        out.append((candidate, options))
    return out


Outcome = tuple[str, Any]
"""("report", the Report), ("usage", the one-line message) or ("lost", why the check gave no report)."""


def _checked(entries: list[tuple[str, dict[str, Any]]], *, shared: bool) -> Iterator[Outcome]:
    """One outcome per entry, in order, as each check ends, checked where torch is imported. With ``shared``
    options an invalid argument is every entry's, so the outcomes end after its first usage outcome."""
    from offload_adamw.conformance.checker import CandidateLoadError, UsageError, check

    for candidate, options in entries:
        try:
            yield "report", check(candidate, **options)
        except CandidateLoadError as exc:
            yield "usage", f"cannot load the candidate: {exc}"
        except UsageError as exc:  # of this candidate: among several, its line says which one
            yield "usage", f"candidate {candidate!r}: {exc}" if len(entries) > 1 else str(exc)
        except ValueError as exc:  # shared options: every candidate's; a batch entry's own: this one's
            yield "usage", str(exc) if shared else f"candidate {candidate!r}: {exc}"
            if shared:
                return


_WAIT_SECONDS = 3600.0
"""How long one wait for the child's next outcome lasts before it is renewed."""


def _check_in_a_child(entries: list[tuple[str, dict[str, Any]]], *, shared: bool) -> Iterator[Outcome]:
    """:func:`_checked` in a forked child where fork exists and torch is not imported here, else here.

    The child imports torch (and torch._dynamo, which the steps of torch's optimizers import) and ends
    with os._exit; this process, which never imported them, then ends without tearing them down
    (about as long as importing them), and what the candidate does cannot reach it either. The child's
    stdout is its stderr, so that what a candidate prints (every process of the check is forked from the
    child) never mixes into the reports or the JSON this process prints. Each outcome comes back as its
    check ends; a child that ends before the last is one ("lost", why) outcome, after those it sent."""
    if "torch" in sys.modules or not hasattr(os, "fork"):
        yield from _checked(entries, shared=shared)
        return
    from offload_adamw.conformance.processes import CandidateProcess, exit_text

    def checks(send: Any) -> None:
        sys.stdout.flush()
        os.dup2(2, 1)  # the descriptors, whatever objects sys.stdout and sys.stderr are here
        for outcome in _checked(entries, shared=shared):
            send(outcome)
        send(("done", None))

    process = CandidateProcess(checks, own_group=False)  # as this process is: an interrupt reaches the checks
    try:
        while True:
            kind, message = process.receive(_WAIT_SECONDS)
            if kind == "late":  # no limit here: each check has its own
                continue
            if kind != "message":
                yield "lost", f"the process that ran the checks ended ({exit_text(message)}) before the last report"
                return
            if message[0] == "done":
                return
            yield message
    finally:
        process.close()


def _summary(candidates: list[str], outcomes: list[Outcome]) -> str:
    """One row per candidate (``outcomes`` holds one each): conforming or not (and the clauses that fail or err),
    or not checked."""
    from offload_adamw._output import render_table

    rows = []
    for candidate, (kind, outcome) in zip(candidates, outcomes):
        if kind == "report":
            failed = ",".join(str(r.number) for r in outcome.failed) or "-"
            verdict = "conforming" if outcome.conforming else "NOT conforming"
            rows.append([candidate, outcome.dtype, verdict, failed, f"{outcome.seconds:.1f}"])
        else:
            rows.append([candidate, "-", "not checked", "-", "-"])  # why: its line on stderr
    return render_table(["candidate", "dtype", "verdict", "failing clauses", "seconds"], rows, align="lllrr", wrap=0)


def run(args: argparse.Namespace) -> int:
    try:
        if bool(args.candidates) == (args.batch is not None):
            raise ValueError("give the candidates to check, or --batch FILE, not both" if args.candidates
                             else "give a candidate to check ('package.module:Class'), or --batch FILE")
        defaults = _flag_options(args)
        entries = ([(c, defaults) for c in args.candidates] if args.batch is None
                   else _batch_entries(args.batch, defaults))
    except ValueError as exc:
        print(f"offload-adamw check: {exc}", file=sys.stderr)
        return 2
    candidates = [c for c, _ in entries]
    several = len(entries) > 1 or args.batch is not None
    tables = not common.json_to_stdout(args, "json_path")
    outcomes: list[Outcome] = []
    for kind, outcome in _check_in_a_child(entries, shared=args.batch is None):
        outcomes.append((kind, outcome))
        if kind != "report":
            print(f"offload-adamw check: {outcome}", file=sys.stderr)
        elif tables:
            print(outcome.to_table() + ("\n" if several else ""), flush=True)
    lost = bool(outcomes) and outcomes[-1][0] == "lost"
    if not several:
        if outcomes and outcomes[0][0] == "report":
            common.write_json("check", outcomes[0][1].to_json(), args.json_path)
    else:
        # the candidates the outcomes stopped before: after a lost process, for its reason; else an invalid argument's
        rest = ("lost", outcomes[-1][1]) if lost else ("usage", "not checked: an invalid argument stopped the check")
        each = outcomes + [rest] * (len(candidates) - len(outcomes))
        if tables:
            print(_summary(candidates, each))
        reports = [{k: v for k, v in o.to_json().items() if k != "schema_version"} for kind, o in each if kind == "report"]
        not_checked = [{"candidate": c, "why": str(o)} for c, (kind, o) in zip(candidates, each) if kind != "report"]
        common.write_json("check", {"reports": reports, "not_checked": not_checked}, args.json_path)
    if any(kind == "usage" for kind, _ in outcomes) or (len(outcomes) < len(candidates) and not lost):
        return 2
    return 0 if not lost and all(o.conforming for _, o in outcomes) else 1
