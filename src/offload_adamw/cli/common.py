"""What every subcommand shares: one error path, one ``--json`` convention, one progress switch.

Exit status, the same for every subcommand (each ``--help`` lists it, with what 0 and 1 mean there):

* 0: done, and the answer is positive;
* 1: done, and the answer is negative (a clause fails, nothing fits, the audit has faults);
* 2: usage error, found before any work starts: a bad argument or input file, an output path
  that cannot be written, an optional package that the asked-for output needs. One line on
  stderr, ``offload-adamw COMMAND: ...``, names the culprit; no traceback;
* 74: the work was done but an output (a file, or stdout) could not be written at the end (a full
  disk, a file-size limit): one line on stderr naming the flag and file (or stdout) and why; no traceback;
* 130: interrupted (Ctrl-C): one line on stderr, no traceback; the processes the command started
  end with it, as a shell reports a process that SIGINT ended;
* 141: stdout was closed before everything was written (``... | head -1``); the command ends
  quietly, as a process killed by SIGPIPE would.

Contract:

* :class:`UsageError` raised by a subcommand's ``run()`` (or by :func:`check_outputs`) is
  turned into exit status 2 by :func:`offload_adamw.cli.main.main`; so are argparse's errors
  (:class:`Parser` writes them as one line).
* ``--json [FILE]`` (:func:`add_json_argument`) means the same in every subcommand: the
  result as a JSON document written to FILE; with no FILE, or ``-``, to stdout in place of
  the tables. Messages and progress bars always go to stderr. Every document starts with
  ``schema_version`` and ``command`` and holds only finite numbers
  (:func:`offload_adamw._output.finite_json`: non-finite values are ``null``, listed
  under ``"nonfinite"``).
* Output files (``--json FILE``, ``--plot FILE.png``) are registered by
  :func:`add_json_argument` and :func:`add_plot_argument`; :func:`check_outputs` checks
  them after parsing and before ``run()`` (:func:`writable_file`): the directory exists and is
  writable (a file in the way is named), the path is not a directory, an existing file takes a
  write (a zero-byte write through a non-blocking descriptor, opened without creating or
  truncating anything: ``/dev/full`` refuses it, a FIFO without a reader cannot be opened), and the
  packages the output needs (matplotlib for ``--plot``) import. A write that still fails at the
  end (:func:`writing`) is :class:`OutputError`: exit status 74 and one line.
* Input files (``--config``, ``--batch``, ``--kwargs @FILE``, an audited file) are regular files,
  looked at before they are opened (:func:`input_file`), and read through a non-blocking
  descriptor checked again (:func:`read_input`), at most :data:`INPUT_LIMIT_BYTES` (16 MiB):
  a FIFO, a device (``/dev/zero``) or a directory is refused by what it is, never read.
* stdout is an output too: one that takes no write (``> /dev/full``) is refused before ``run()``
  (:func:`check_stdout`), and a write to it that fails later is :class:`OutputError`
  (:class:`GuardedStdout`, which :func:`offload_adamw.cli.main.main` puts in place while a command runs).
* ``--progress/--no-progress`` (:func:`add_progress_argument`): progress bars on stderr;
  by default only when stderr is a terminal, never into a log file.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import json
import os
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from offload_adamw._output import (
    SCHEMA_VERSION,
    file_kind,
    finite_json,
    json_document,
    render_table,
    terminal_width,
)

__all__ = [
    "SCHEMA_VERSION",
    "EXIT_CLOSED_PIPE",
    "EXIT_INTERRUPTED",
    "EXIT_OUTPUT_FAILED",
    "INPUT_LIMIT_BYTES",
    "UsageError",
    "OutputError",
    "GuardedStdout",
    "check_stdout",
    "Parser",
    "exit_codes_text",
    "add_json_argument",
    "add_plot_argument",
    "add_progress_argument",
    "check_outputs",
    "writable_file",
    "writable_directory",
    "input_file",
    "read_input",
    "file_kind",
    "writing",
    "require_package",
    "json_to_stdout",
    "write_json",
    "progress_wanted",
    "closed_pipe",
    "render_table",
    "terminal_width",
    "finite_json",
    "json_document",
]

EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped with Ctrl-C
EXIT_OUTPUT_FAILED = 74  # sysexits' EX_IOERR: not 1, which means a negative answer, nor 2, which means nothing ran
INPUT_LIMIT_BYTES = 16 * 2**20
"""The most an input file (a config, a batch, a JSON argument) may hold: each is a few kilobytes."""

_OUTPUTS_ATTR = "_offload_adamw_outputs"  # on a parser: [(dest, flag, needs)] of its output-file arguments


class UsageError(Exception):
    """A bad argument or input, found before any work: exit status 2 and the message on one line."""


class OutputError(Exception):
    """An output file that could not be written after the work was done: exit status 74 and the message on one line."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) and the help's epilog printed as written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's hook; never returns
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def exit_codes_text(meanings: dict[int, str] | None = None) -> str:
    """The exit-status list for a ``--help`` epilog; ``meanings`` says what 0 and 1 mean for the command."""
    meanings = meanings or {}
    lines = ["exit status:"]
    lines.append(f"  0    {meanings.get(0, 'done')}")
    if 1 in meanings:
        lines.append(f"  1    {meanings[1]}")
    lines.append("  2    usage error (bad argument, input, output path or missing optional package), before any work")
    lines.append(f"  {EXIT_OUTPUT_FAILED}   work done, but an output (a file, stdout) could not be written (disk full, ...)")
    lines.append(f"  {EXIT_INTERRUPTED}  interrupted (Ctrl-C); what the command started ends with it")
    lines.append(f"  {EXIT_CLOSED_PIPE}  stdout closed early (e.g. piped into head); ends quietly")
    return "\n".join(lines)


def _register(parser: argparse.ArgumentParser, dest: str, flag: str, needs: Sequence[tuple[str, str]]) -> None:
    outputs = getattr(parser, _OUTPUTS_ATTR, None)
    if outputs is None:
        outputs = []
        setattr(parser, _OUTPUTS_ATTR, outputs)
    outputs.append((dest, flag, tuple(needs)))


def add_json_argument(parser: argparse.ArgumentParser, *, what: str = "the result", dest: str = "json",
                      parent: Any | None = None) -> None:
    """``--json [FILE]``: ``what`` as JSON to FILE, or with no FILE (or ``-``) to stdout instead of the tables.

    ``parent`` is an argument group of ``parser`` to list it in.
    """
    (parent or parser).add_argument("--json", dest=dest, nargs="?", const="-", default=None, metavar="FILE",
                        help=f"write {what} as JSON to FILE; with no FILE or '-', to stdout instead of the tables")
    _register(parser, dest, "--json", ())


def add_plot_argument(parser: argparse.ArgumentParser, *, what: str = "a chart", dest: str = "plot",
                      parent: Any | None = None) -> None:
    """``--plot FILE.png`` (needs matplotlib, the ``plot`` extra); ``parent`` is an argument group to add it to."""
    (parent or parser).add_argument("--plot", dest=dest, metavar="FILE.png", default=None,
                                    help=f"write {what} as a PNG (needs matplotlib: pip install 'offload-adamw[plot]')")
    _register(parser, dest, "--plot", (("matplotlib", "plot"),))


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    """``--progress/--no-progress``: progress bars on stderr (default: only when stderr is a terminal)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars on stderr (default: only when stderr is a terminal)")


def progress_wanted(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars: the flag when given, else whether stderr is a terminal."""
    chosen = getattr(args, "progress", None)
    if chosen is not None:
        return bool(chosen)
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _file_in_the_way(target: Path) -> str | None:
    """Where an ancestor of ``target`` exists and is no directory: "X is a file, not a directory" (else None)."""
    for ancestor in reversed(target.absolute().parents):
        try:
            mode = os.stat(ancestor).st_mode
        except OSError:
            return None  # absent (or unreadable): the checks that follow say so
        if not stat.S_ISDIR(mode):
            kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
            return f"{ancestor} is {kind}, not a directory"
    return None


def _takes_a_write(target: Path, flag: str) -> None:
    """An existing ``target`` accepts a write: opened without creating, truncating or blocking, and written 0 bytes.

    A zero-byte write changes nothing anywhere (a file, a pipe, a terminal) and fails where every write
    would (``/dev/full``: no space left); a FIFO without a reader cannot be opened without blocking.
    """
    mode = os.stat(target).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        raise UsageError(f"{flag} {str(target)!r}: is {file_kind(mode)}; give a file name")
    try:
        fd = os.open(target, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        why = "a FIFO (named pipe) with no reader" if exc.errno == errno.ENXIO else (exc.strerror or str(exc))
        raise UsageError(f"{flag} {str(target)!r}: cannot be written ({why})") from None
    try:
        os.write(fd, b"")
    except OSError as exc:
        raise UsageError(f"{flag} {str(target)!r}: cannot be written ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def writable_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a Path once it is clear that a file can be written there; else UsageError naming ``flag``."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {str(target)!r}: is a directory; give a file name")
    in_the_way = _file_in_the_way(target)
    if in_the_way is not None:
        raise UsageError(f"{flag} {str(target)!r}: {in_the_way}")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        raise UsageError(f"{flag} {str(target)!r}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{flag} {str(target)!r}: {str(parent)!r} is not a directory")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {str(target)!r}: the file is not writable")
    if not target.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {str(target)!r}: directory {str(parent)!r} is not writable")
    if target.exists():
        _takes_a_write(target, flag)
    return target


def writable_directory(path: str | os.PathLike[str], flag: str) -> Path:
    """A directory that exists and is writable, or can be created; else UsageError naming ``flag``."""
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise UsageError(f"{flag} {str(target)!r}: exists and is not a directory")
        if not os.access(target, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {str(target)!r}: the directory is not writable")
        return target
    in_the_way = _file_in_the_way(target)
    if in_the_way is not None:
        raise UsageError(f"{flag} {str(target)!r}: cannot be created ({in_the_way})")
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {str(target)!r}: cannot be created ({str(ancestor)!r} is not a writable directory)")
    return target


@contextlib.contextmanager
def writing(flag: str, target: str | os.PathLike[str]) -> Iterator[None]:
    """Around the write of an output file at the end of the work: a failure is :class:`OutputError` naming
    ``flag`` and the file (exit status 74, one line), never a traceback."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{flag} {os.fspath(target)}: could not write ({exc.strerror or exc}); the work was done, "
                          "this file is missing or incomplete") from None


def _named(flag: str, target: Path) -> str:
    return f"{flag} {str(target)!r}" if flag else repr(str(target))


def input_file(path: str | os.PathLike[str], flag: str, *, limit: int | None = INPUT_LIMIT_BYTES) -> Path:
    """``path`` once it is clear that it is a regular file (of at most ``limit`` bytes); else UsageError naming
    ``flag`` (none for a positional argument) and saying what it is. Looked at only (stat, through links),
    never opened: opening a FIFO to read blocks."""
    target = Path(path)
    try:
        found = os.stat(target)
    except FileNotFoundError:
        in_the_way = _file_in_the_way(target)
        raise UsageError(f"{_named(flag, target)}: {in_the_way or 'no such file'}") from None
    except OSError as exc:
        raise UsageError(f"{_named(flag, target)}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(found.st_mode):
        raise UsageError(f"{_named(flag, target)}: is {file_kind(found.st_mode)}, not a regular file")
    if limit is not None and found.st_size > limit:
        raise UsageError(f"{_named(flag, target)}: {found.st_size:,} bytes, larger than the {limit // 2**20} MiB "
                         "an input file may hold")
    return target


def read_input(path: str | os.PathLike[str], flag: str, *, limit: int = INPUT_LIMIT_BYTES) -> str:
    """The text of the regular file ``path``, at most ``limit`` bytes; else UsageError naming ``flag`` and why.

    Looked at first (:func:`input_file`), opened without blocking and looked at again through the
    descriptor (a FIFO put there meanwhile is refused, not waited on), and never read past ``limit``
    (a file that grows meanwhile is refused too).
    """
    target = input_file(path, flag, limit=limit)
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{_named(flag, target)}: cannot be read ({exc.strerror or exc})") from None
    with open(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(f"{_named(flag, target)}: is {file_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise UsageError(f"{_named(flag, target)}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise UsageError(f"{_named(flag, target)}: larger than the {limit // 2**20} MiB an input file may hold")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{_named(flag, target)}: not a UTF-8 text file (byte {exc.start})") from None


def require_package(module: str, extra: str, why: str) -> None:
    """UsageError unless ``module`` can be imported (found without importing it)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules (blocked) or a broken package
        found = False
    if not found or sys.modules.get(module, 0) is None:
        raise UsageError(f"{why} needs {module}; install it with: pip install 'offload-adamw[{extra}]'")


def _silence_stdout() -> None:
    """Send what stdout still holds (and writes at exit) to the null device: after its failure, nothing more to say there."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (captured): nothing to silence
        pass


def check_stdout() -> None:
    """UsageError where stdout takes no write at all (``> /dev/full``): a zero-byte write, which changes nothing."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # captured or replaced: not a descriptor to probe
        return
    try:
        os.write(fd, b"")
    except BrokenPipeError:
        return  # a reader that went away: the closed-pipe ending (141) handles it
    except OSError as exc:
        if exc.errno == errno.EBADF:
            return  # no stdout at all: left as it was
        raise UsageError(f"stdout: cannot be written ({exc.strerror or exc})") from None


class GuardedStdout:
    """``sys.stdout`` while a command runs: a failed write or flush (a full disk, a file-size limit) is
    :class:`OutputError` (one line, exit status 74), not a traceback; a closed pipe stays BrokenPipeError."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _failed(self, exc: OSError) -> OutputError:
        _silence_stdout()  # so that the interpreter's flush at exit does not print a second error
        return OutputError(f"stdout: could not write ({exc.strerror or exc}); the output is incomplete")

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """stdout and every registered output of ``parser`` that ``args`` asks for can be written, and their packages
    import."""
    check_stdout()
    for dest, flag, needs in getattr(parser, _OUTPUTS_ATTR, ()):
        value = getattr(args, dest, None)
        if value is None or value == "-":
            continue
        for module, extra in needs:
            require_package(module, extra, f"{flag} {value}")
        writable_file(value, flag)


def json_to_stdout(args: argparse.Namespace, dest: str = "json") -> bool:
    """Whether ``--json`` sends the document to stdout (and the tables are left out)."""
    return getattr(args, dest, None) == "-"


def write_json(command: str, body: dict[str, Any], target: str | None) -> None:
    """Write ``body`` as the JSON document of ``command`` to ``target`` ('-' is stdout; None writes nothing)."""
    if target is None:
        return
    text = json.dumps(json_document(command, body), indent=2, allow_nan=False) + "\n"
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with writing("--json", target):
        Path(target).write_text(text)
    print(f"wrote {target}", file=sys.stderr)


def closed_pipe() -> int:
    """After a BrokenPipeError on stdout: silence further writes (also at exit) and return the exit status."""
    _silence_stdout()
    return EXIT_CLOSED_PIPE
