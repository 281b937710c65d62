"""Atomic publication of a checkpoint directory: fsync, rename or exchange, locks, clean-up. No torch.

Contract:

* A checkpoint is built in a hidden sibling directory :func:`temporary_name` ``.NAME.tmp-OWNER-PID-TOKEN``
  (OWNER: this machine, boot and PID namespace, hashed: :func:`owner`), locked (:func:`lock`) while it
  is written; every file and the directory are fsynced (:func:`write_bytes`, :func:`fsync_path`).
* :func:`publish` moves it onto its final name in one step. A new checkpoint is created with
  :func:`create`: "only if nothing is there" and the move are one system call
  (``renameat2(RENAME_NOREPLACE)`` on Linux, else a plain rename, which cannot replace a file or a
  non-empty directory), so of several saves racing to create one path exactly one succeeds and
  the others get FileExistsError. Replacing one is one atomic exchange where the OS has
  ``renameat2(RENAME_EXCHANGE)``. The environment variable ``OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE=0``
  turns renameat2 off (the portable paths run). Without the exchange it is two renames, and between
  them the previous checkpoint waits at ``.NAME.prev-OWNER-PID-TOKEN`` (:func:`previous_copies` finds it).
* :func:`seal` writes the manifest (size and sha256 of every data file), then the commit marker
  (the sha256 of the manifest). A reader opens a published directory once as a :class:`Snapshot`
  (the directory and every file through descriptors) and reads only through it: :func:`check_seal`
  checks the marker, the manifest and every file there, refusing with :class:`CheckpointCorrupt`
  naming every damaged file, and what it checked is what the reader then parses, even while a save
  replaces or deletes the directory.
* Nothing but a regular file is ever opened for reading (:func:`open_regular`: lstat, open without
  following a link and without blocking, fstat): a FIFO, a device, a directory or a symbolic link where
  a checkpoint has a file is refused by name (:class:`NotRegularFile`; :func:`check_seal` says which),
  so a FIFO can never block a reader.
* :func:`remove_stale` deletes what killed saves left, but only temporaries of this machine whose
  writer no longer runs, whose lock nobody holds and which hold nothing but checkpoint files.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

from offload_adamw._output import file_kind
from offload_adamw.checkpoint.errors import CheckpointCorrupt, CheckpointError
from offload_adamw.checkpoint.layout import COMMIT_FILE, FORMAT, MANIFEST_FILE, VERSION, dumps, is_count, written_by_a_save

ENV_EXCHANGE = "OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE"
TMP_TAG = ".tmp-"
PREV_TAG = ".prev-"
_SAFETENSORS_TEMPORARY = re.compile(r"\.tmp[A-Za-z0-9]{6}")

# Module-level functions so that the fault tests can stop a process between any two of them.


def fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """``renameat2(a, b, flags)``: True when done, False where the OS or filesystem lacks it (or
    ``OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE=0`` turns it off); any other failure is raised as OSError."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV_EXCHANGE, "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically; False where the OS or filesystem cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def create(tmp: Path, final: Path) -> None:
    """Move the directory ``tmp`` to ``final`` only if nothing is there, in one step; else FileExistsError.

    The check and the move are one system call, so of several saves that race to create ``final``
    exactly one succeeds (checking first and renaming afterwards would let each of them replace the
    one before). ``renameat2(RENAME_NOREPLACE)`` where the OS has it; elsewhere a plain rename, which
    is atomic too: a directory cannot be renamed onto a file or a non-empty directory (and Windows
    renames onto nothing that exists). Its one gap: it may replace an *empty* directory that appeared
    at ``final`` meanwhile, and nothing is lost with that.
    """
    try:
        if _renameat2(tmp, final, _RENAME_NOREPLACE):
            return
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(final))
        os.rename(tmp, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR) or isinstance(exc, FileExistsError):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(final)) from None
        raise


def owner() -> str:
    """This machine, boot and PID namespace, hashed (16 hex digits): with the PID, who wrote a temporary.

    A PID says nothing about a process of another host or container sharing the directory (NFS, a
    bind mount); only temporaries of this very machine, boot and namespace are judged by their PID.
    """
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(source).read_text().strip() if source.endswith("boot_id") else str(os.stat(source).st_ino))
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def temporary_name(final: Path, tag: str) -> Path:
    return final.with_name(f".{final.name}{tag}{owner()}-{os.getpid()}-{secrets.token_hex(4)}")


TEMPORARY = re.compile(r"^\.(?P<target>.+)\.(?P<kind>tmp|prev)-(?P<owner>[0-9a-f]{16})-(?P<pid>[0-9]+)-[0-9a-f]{8}$")


def lock(directory: Path) -> int | None:
    """An exclusive lock on ``directory`` held by this process until :func:`unlock` (None where unsupported)."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the lock


def discard(tmp: Path | None, fd: int | None) -> None:
    """A failed save's clean-up: its lock released, its temporary removed (nothing of it was published)."""
    unlock(fd)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, final: Path, *, replace: bool) -> Path | None:
    """Move the finished ``tmp`` onto ``final``; return the directory that now holds the old one.

    Without ``replace``, :func:`create`: FileExistsError where anything is at ``final`` by then,
    and ``tmp`` is left as it is.
    """
    if not replace:
        create(tmp, final)
        return None
    if not os.path.lexists(final):
        try:
            create(tmp, final)
            return None
        except FileExistsError:
            pass  # another save published there meanwhile: replace it, as asked
    if exchange(tmp, final):
        return tmp  # after the swap the temporary name holds the previous checkpoint
    # No atomic exchange here: for a moment ``final`` is absent and the previous
    # checkpoint sits at the .prev- name. resolve(), latest() and load() find it
    # there, and no clean-up deletes it until ``final`` is complete again.
    previous = temporary_name(final, PREV_TAG)
    os.rename(final, previous)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(previous, final)  # put the previous checkpoint back where it was
        raise
    return previous


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours_and_abandoned(entry: Path, writer: str, pid: int) -> bool:
    """Whether ``entry`` was written by a save of a process of this machine that no longer runs."""
    if writer != owner() or pid == os.getpid() or _pid_alive(pid):
        return False

    def ours(name: str) -> bool:
        # safetensors writes each file through a temporary beside it (".tmp" and 6 characters, Rust's tempfile),
        # which a kill during that write leaves behind.
        return written_by_a_save(name) or _SAFETENSORS_TEMPORARY.fullmatch(name) is not None

    try:
        if entry.is_symlink() or not entry.is_dir():
            return False
        if not all(ours(child.name) and child.is_file() and not child.is_symlink() for child in entry.iterdir()):
            return False  # something a save never writes: not ours to delete
    except OSError:
        return False
    fd = lock(entry)  # a writer holds this lock while it fills its temporary
    if fd is None:
        return False
    unlock(fd)
    return True


def remove_stale(parent: Path) -> None:
    """Delete what killed saves of this machine left in ``parent``, and nothing else.

    A name ``.NAME.tmp-OWNER-PID-TOKEN`` / ``.NAME.prev-OWNER-PID-TOKEN`` is
    judged only where OWNER is this machine, boot and PID namespace, its PID no
    longer runs, no process holds the directory's lock, and it holds nothing but
    checkpoint files. A ``.tmp-`` directory is then never the only complete copy
    of anything (after an exchange it holds the replaced checkpoint); a
    ``.prev-`` directory (no atomic exchange) may be, so it goes only once
    ``NAME`` is complete again.
    """
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = TEMPORARY.match(entry.name)
        if match is None:
            continue
        if match["kind"] == "prev" and not (parent / match["target"] / COMMIT_FILE).is_file():
            continue
        if _ours_and_abandoned(entry, match["owner"], int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def previous_copies(final: Path) -> list[Path]:
    """The ``.prev-`` directories of ``final`` (a save without atomic exchange that was interrupted)."""
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        match = TEMPORARY.match(entry.name)
        if match is not None and match["kind"] == "prev" and match["target"] == final.name:
            out.append(entry)
    return out


# ----------------------------------------------------------- reading one


class NotRegularFile(OSError):
    """Something other than a regular file (``kind``, in words) where a checkpoint has a file; it was not opened."""

    def __init__(self, path: str | Path, kind: str):
        super().__init__(errno.EINVAL, f"{path} is {kind}, not a regular file", str(path))
        self.kind = kind


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | Path, *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path`` (relative to ``dir_fd`` where given).

    Anything else raises :class:`NotRegularFile` without being opened: opening a FIFO for reading
    blocks until a writer comes, a device may do anything, and a symbolic link is nothing a save
    writes. It is looked at first (lstat), then opened without following a link and without
    blocking (so that a FIFO put there meanwhile cannot block either), then looked at again
    through the descriptor. FileNotFoundError where nothing is there.
    """
    found = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(found.st_mode):
        raise NotRegularFile(path, file_kind(found.st_mode))
    try:
        fd = os.open(path, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link put there after the lstat
            raise NotRegularFile(path, "a symbolic link") from None
        raise
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):
        os.close(fd)
        raise NotRegularFile(path, file_kind(opened.st_mode))
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path) -> bytes:
    """The bytes of the regular file ``path``; :class:`NotRegularFile` (never opened) for anything else."""
    with open(open_regular(path), "rb") as f:
        return f.read()



class Snapshot:
    """A published checkpoint directory opened once: its files as they were when it was opened.

    The directory and each of its files are opened through descriptors right away, and everything
    is read through those: a save that exchanges, renames or deletes the directory afterwards changes
    nothing of what this snapshot holds (published checkpoints are never written in place). So what
    :func:`check_seal` verified is what the caller parses. ``missing`` names the files that could not
    be opened; :meth:`replaced` says whether ``root`` still names the directory opened.
    """

    def __init__(self, root: Path, names: Iterable[str]):
        self.root = root
        self._dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # FileNotFoundError, NotADirectoryError
        self._fds: dict[str, int] = {}
        self.missing: list[str] = []
        self.irregular: dict[str, str] = {}
        """name -> what is there instead of a regular file (never opened): :func:`check_seal` refuses it."""
        self.open_more(names)

    def _open(self, name: str) -> int | None:
        """A descriptor of the regular file ``name`` in the directory opened, or None where nothing is there."""
        try:
            if os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd:
                return open_regular(name, dir_fd=self._dir_fd)
            return open_regular(self.root / name)  # no openat (Windows): by path, which a replacement can still race
        except (FileNotFoundError, NotADirectoryError):
            return None

    def open_more(self, names: Iterable[str]) -> None:
        """Open further files of the same directory (through its descriptor: the directory opened, not ``root``)."""
        for name in names:
            if name in self._fds or name in self.missing or name in self.irregular:
                continue
            try:
                fd = self._open(name)
            except NotRegularFile as exc:
                self.irregular[name] = exc.kind
                continue
            if fd is None:
                self.missing.append(name)
            else:
                self._fds[name] = fd

    def listing(self) -> list[str]:
        """The names in the directory opened (not in whatever ``root`` names now)."""
        return sorted(os.listdir(self._dir_fd))

    def replaced(self) -> bool:
        """Whether ``root`` names another directory now (or nothing): a save replaced it while it was opened."""
        try:
            now = os.stat(self.root)
        except OSError:
            return True
        opened = os.fstat(self._dir_fd)
        return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)

    def has(self, name: str) -> bool:
        return name in self._fds

    def size(self, name: str) -> int:
        return os.fstat(self._fds[name]).st_size

    def read(self, name: str) -> bytes:
        with open(self._fds[name], "rb", closefd=False) as f:
            f.seek(0)
            return f.read()

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        with open(self._fds[name], "rb", closefd=False) as f:
            f.seek(0)
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        return digest.hexdigest()

    def reopenable(self, name: str) -> str | None:
        """A path that opens this very file again (Linux: ``/proc/self/fd/N``, even once it is deleted), or None."""
        path = f"/proc/self/fd/{self._fds[name]}"
        return path if os.path.exists(path) else None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self._dir_fd)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------- the seal


def digest(path: Path) -> dict[str, Any]:
    """A manifest entry: the size and sha256 of the file ``path``."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def seal(directory: Path, files: Sequence[str], *, version: int = VERSION, digests: dict[str, Any] | None = None) -> None:
    """Write the manifest (size and sha256 of each of ``files``), then the commit marker that vouches for it.

    ``digests`` holds entries already computed (by the rank that wrote the file), the rest are computed here.
    """
    known = digests or {}
    manifest = {
        "format": FORMAT,
        "version": version,
        "files": {name: known[name] if name in known else digest(directory / name) for name in files},
    }
    manifest_bytes = dumps(manifest)
    write_bytes(directory / MANIFEST_FILE, manifest_bytes)
    write_bytes(directory / COMMIT_FILE, dumps({"format": FORMAT, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}))


def check_seal(snapshot: Snapshot, files: Sequence[str], *, version: int = VERSION) -> None:
    """The commit marker, the manifest it vouches for, and the size and sha256 of each of ``files``.

    :class:`CheckpointCorrupt` naming what is damaged (every damaged file at once).
    """
    root = snapshot.root
    _refuse_irregular(snapshot)
    manifest = _manifest(snapshot, _manifest_sha256(snapshot), files, version=version)
    damaged = _damaged(snapshot, manifest, files)
    if damaged:
        raise CheckpointCorrupt(f"refusing to load {root}: " + "; ".join(damaged))


def manifest_version(snapshot: Snapshot) -> Any:
    """The version the manifest of ``snapshot`` declares (None where there is no readable one): which layout to read."""
    if not snapshot.has(MANIFEST_FILE):
        return None
    try:
        return json.loads(snapshot.read(MANIFEST_FILE)).get("version")
    except (ValueError, AttributeError, RecursionError):
        return None


def manifest_files(snapshot: Snapshot, *, version: int) -> dict[str, Any]:
    """The manifest's file entries (name -> size and sha256), after its sha256 was checked against the commit marker."""
    _refuse_irregular(snapshot)
    return cast(dict[str, Any], _manifest(snapshot, _manifest_sha256(snapshot), (), version=version)["files"])


def check_files(snapshot: Snapshot, entries: dict[str, Any], names: Sequence[str]) -> list[str]:
    """What is damaged among ``names`` (each compared with its manifest entry in ``entries``), one sentence each."""
    _refuse_irregular(snapshot)
    return _damaged(snapshot, {"files": entries}, names)


def _refuse_irregular(snapshot: Snapshot) -> None:
    root = snapshot.root
    if snapshot.irregular:
        # named first: a FIFO, device, directory or link where a file belongs was put there, never written by a save
        raise CheckpointCorrupt(f"refusing to load {root}: " + "; ".join(
            f"{name} is {kind}, not a regular file (a save writes only regular files; it was not opened)"
            for name, kind in snapshot.irregular.items()))


def _damaged(snapshot: Snapshot, manifest: dict[str, Any], files: Sequence[str]) -> list[str]:
    damaged = []
    for name in files:
        entry = manifest["files"].get(name)
        if entry is None:
            damaged.append(f"{name}: not in the manifest")
        elif not snapshot.has(name):
            damaged.append(f"{name}: missing")
        elif snapshot.size(name) != entry["bytes"]:
            damaged.append(f"{name}: {snapshot.size(name)} bytes, the manifest says {entry['bytes']} (truncated or overwritten)")
        elif snapshot.sha256(name) != entry["sha256"]:
            damaged.append(f"{name}: sha256 mismatch (the file changed after it was written)")
    return damaged


def _manifest_sha256(snapshot: Snapshot) -> str:
    """The manifest's sha256 as the commit marker records it."""
    root, commit = snapshot.root, snapshot.root / COMMIT_FILE
    if not snapshot.has(COMMIT_FILE):
        raise CheckpointCorrupt(
            f"{root} is incomplete: it has no {COMMIT_FILE} marker (its save was interrupted); use an earlier checkpoint"
        )
    try:
        return str(json.loads(snapshot.read(COMMIT_FILE))["manifest_sha256"])
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{commit}: unreadable commit marker ({exc})") from exc


def _manifest(snapshot: Snapshot, expected_sha256: str, files: Sequence[str], *, version: int = VERSION) -> dict[str, Any]:
    """The manifest, matching the commit marker, well formed, of this format and version."""
    root, manifest_path = snapshot.root, snapshot.root / MANIFEST_FILE
    if not snapshot.has(MANIFEST_FILE):
        raise CheckpointCorrupt(f"{root}: {MANIFEST_FILE} is missing")
    data = snapshot.read(MANIFEST_FILE)
    found = hashlib.sha256(data).hexdigest()
    if found != expected_sha256:
        raise CheckpointCorrupt(f"{manifest_path}: sha256 {found} does not match the commit marker ({expected_sha256})")
    try:
        manifest = json.loads(data)
        for name in files or manifest["files"]:
            entry = manifest["files"].get(name)
            if entry is not None and not (
                isinstance(entry, dict) and is_count(entry.get("bytes")) and isinstance(entry.get("sha256"), str)
            ):
                raise ValueError(f"the entry of {name} is not {{'bytes': int, 'sha256': str}}")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{manifest_path}: malformed manifest ({exc!r})") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != version:
        raise CheckpointCorrupt(
            f"{root}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
            f"expected {FORMAT!r} version {version}"
        )
    return cast(dict[str, Any], manifest)


def seal_and_publish(tmp: Path, final: Path, files: Sequence[str], *, replace: bool, version: int = VERSION,
                     digests: dict[str, Any] | None = None) -> Path | None:
    """Seal the finished ``tmp`` (:func:`seal`), make it durable and publish it at ``final`` (:func:`publish`); return
    the directory that now holds the old one. Without ``replace``, a ``final`` that another save or process created
    after the caller looked is a :class:`CheckpointError`, and nothing is published."""
    seal(tmp, files, version=version, digests=digests)
    fsync_path(tmp, directory=True)
    try:
        return publish(tmp, final, replace=replace)
    except FileExistsError:
        raise CheckpointError(
            f"{final} exists (it was created while this save was writing, by another save or process); "
            "pass overwrite=True to replace it atomically. This save published nothing; what is there is unchanged"
        ) from None
