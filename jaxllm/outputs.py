"""The one place that owns every file a command writes: model directories, single files
(``--json``, ``--plot``, a figure's data) and run directories. Every writer goes through it, so
each command inherits the same promises:

* an output that is also an input of the same command (the same file, or a path inside, or
  containing, a directory being read) is refused in one line before any work;
* nothing jaxllm did not write is replaced or deleted: a directory is ours when it holds
  :data:`MARKER` (written last into every directory we write) and nothing else besides its
  own kind of entries; a single file is ours when the directory's :data:`REGISTRY` lists it
  with the digest it still has (so a file the user edited since is theirs again); a run
  directory when it holds its manifest, written before anything else;
* writes go to a temporary name beside the target and are renamed into place, so an
  interrupted write never leaves half a file where a good one was; files that appear in the
  target while we write are never overwritten: the new output is kept beside it and named;
* a write that fails (a read-only directory, a path naming a directory, a full disk) is one
  line naming the path and the reason;
* a temporary output is judged abandoned only when the lock its writer holds on
  ``TEMP.jaxllm-lock`` beside it (``fcntl.flock``, taken before the temporary exists) is free:
  a writer in another PID namespace (a container on a shared volume) keeps its work. A
  replacement killed between its two renames is undone on the next write: the previous output
  goes back in place;
* outputs get the permissions the umask gives (not a temporary file's 0600 / 0700).

Errors are :class:`OutputError` (a ValueError: the CLI prints it in one line)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Callable, Optional

MARKER = ".jaxllm-written"  # in every directory atomic_dir writes: the sign it may be replaced
REGISTRY = ".jaxllm-outputs"  # per directory: the single files written there, with digests
RUN_MANIFEST = ".jaxllm-run"  # first file of every run directory
LOCK = ".jaxllm-lock"  # suffix of the lock file beside each temporary output


class OutputError(ValueError):
    """An output that would lose data, or that cannot be written."""


def _same_or_inside(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def check_not_a_source(path: str, sources=()) -> None:
    """Refuse an output that is, contains or lies inside one of ``sources`` (paths being read),
    symlinks resolved."""
    out = os.path.realpath(path)
    for src in sources:
        s = os.path.realpath(src)
        if _same_or_inside(out, s) or _same_or_inside(s, out):
            raise OutputError(f"the output {path} {'is' if out == s else 'overlaps'} the input "
                              f"{src}: writing it would destroy what is being read; choose an "
                              f"output outside the input")


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _make_parent(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the directory {parent} for {path}: {_why(e)}") \
            from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: {parent} is not writable (permission denied); "
                          f"choose an output in a writable directory")
    return parent


# ---- single files --------------------------------------------------------------------------


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _registry(parent: str) -> dict:
    try:
        with open(os.path.join(parent, REGISTRY)) as f:
            reg = json.load(f)
        return reg if isinstance(reg, dict) else {}
    except (OSError, ValueError):
        return {}


def _register(path: str) -> None:
    parent, name = os.path.split(os.path.abspath(path))
    reg = _registry(parent)
    reg[name] = _digest(path)
    tmp = os.path.join(parent, f".{REGISTRY}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(reg, f, indent=0, sort_keys=True)
    os.replace(tmp, os.path.join(parent, REGISTRY))


def written_by_us(path: str) -> bool:
    """A single file jaxllm wrote and nobody changed since."""
    parent, name = os.path.split(os.path.abspath(path))
    want = _registry(parent).get(name)
    try:
        return want is not None and _digest(path) == want
    except OSError:
        return False


def check_file(path: str, sources=()) -> None:
    """Refuse, before any work, a single-file output that would lose data or cannot be
    written: an input of the command, a directory, a file jaxllm did not write (or that was
    changed since), a place that cannot be written."""
    check_not_a_source(path, sources)
    if os.path.isdir(path):
        raise OutputError(f"the output {path} is a directory; give a file path")
    if os.path.lexists(path) and (os.path.islink(path) or not written_by_us(path)):
        raise OutputError(f"{path} exists and was not written by jaxllm (or was changed since); "
                          f"refusing to replace it: choose a new path or move it away")
    _make_parent(path)


@contextlib.contextmanager
def atomic_file(path: str, sources=()):
    """Yield a temporary path beside ``path``; on success it replaces ``path`` (checked by
    :func:`check_file` before and again just before the rename) and is registered as ours;
    on failure it is removed and ``path`` is untouched."""
    check_file(path, sources)
    parent, name = os.path.split(os.path.abspath(path))
    with _locked_temp(parent, f".{name}.jaxllm-partial-{os.getpid()}-", path, False) as tmp, \
            _removed_on_failure(tmp, path):
        yield tmp
        if os.path.lexists(path) and not written_by_us(path):  # appeared while we wrote
            kept = _keep_beside(tmp, path)
            raise OutputError(f"{path} appeared while jaxllm wrote it (not ours: left as it "
                              f"is); the new output is {kept}")
        _as_umask_allows(tmp)
        os.replace(tmp, path)
        _register(path)


@contextlib.contextmanager
def _locked_temp(parent: str, prefix: str, path: str, directory: bool):
    """A new temporary file or directory in ``parent``, and the lock that marks it as being
    written: the lock file ``TEMP.jaxllm-lock`` is made and locked first, so no cleaner ever
    sees the temporary without a held lock beside it. Released (and its file removed) at the
    end, whatever became of the temporary."""
    try:
        fd, lock = tempfile.mkstemp(prefix=prefix, suffix=LOCK, dir=parent)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {_why(e)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        tmp = lock[:-len(LOCK)]
        try:
            if directory:
                os.mkdir(tmp, 0o700)
            else:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError as e:
            raise OutputError(f"cannot write {path}: {_why(e)}") from None
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (setting it to read
    it would, for that instant, let another thread create files with no mask)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1], 8) for ln in f if ln.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o077)  # elsewhere: briefly the strictest mask, never none
        os.umask(mask)
        return mask


def _as_umask_allows(tmp: str) -> None:
    """A temporary is private while written (0600 / 0700); the output gets the permissions an
    ordinary file or directory made here would have."""
    mask = _umask()
    if os.path.isdir(tmp):
        for d, dirs, files in os.walk(tmp):
            os.chmod(d, 0o777 & ~mask)
            for f in files:
                if not os.path.islink(os.path.join(d, f)):
                    os.chmod(os.path.join(d, f), os.stat(os.path.join(d, f)).st_mode & 0o777
                             | (0o666 & ~mask))
    else:
        os.chmod(tmp, 0o666 & ~mask)


@contextlib.contextmanager
def _removed_on_failure(tmp: str, path: str):
    """On any failure the temporary ``tmp`` goes; an OSError becomes one line about ``path``."""
    try:
        yield
    except OSError as e:
        _remove(tmp)
        raise OutputError(f"cannot write {path}: {_why(e)}") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: str) -> None:
    try:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp)
        elif os.path.lexists(tmp):
            os.remove(tmp)
    except OSError:
        pass


def _keep_beside(tmp: str, path: str) -> str:
    """Rename a finished output that cannot go into place to a visible name beside it."""
    kept = f"{path}.jaxllm-new-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.rename(tmp, kept)
    return kept


def write_json(path: str, obj, sources=()) -> None:
    with atomic_file(path, sources) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)


def write_text(path: str, text: str, sources=()) -> None:
    with atomic_file(path, sources) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


# ---- directories ---------------------------------------------------------------------------


def foreign_entries(path: str, ours: Callable[[str], bool]) -> list:
    """Entries of directory ``path`` that are not ours (by name) nor the marker."""
    return sorted(e for e in os.listdir(path) if e != MARKER and not ours(e))


def check_output_dir(path: str, overwrite: bool = False, sources=(),
                     ours: Callable[[str], bool] = lambda name: False,
                     what: str = "a model") -> None:
    """Refuse an output directory whose replacement would lose data: a file, a non-empty
    directory jaxllm did not write (no marker),
    one holding entries that are not ``ours`` (a file the user put in a model directory), a
    directory written earlier (unless ``overwrite``), or one that overlaps ``sources``."""
    check_not_a_source(path, sources)
    path = os.path.abspath(path)
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        raise OutputError(f"the output {path} exists and is not a directory; choose a new path")
    entries = sorted(os.listdir(path))
    if not entries:
        return
    shown = lambda names: ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")  # noqa
    if MARKER in entries:
        foreign = foreign_entries(path, ours)
        if foreign:
            raise OutputError(f"{path} holds {what} written by jaxllm and files that are not "
                              f"its ({shown(foreign)}); refusing to replace it: move them out "
                              f"or choose a new output")
        if overwrite:
            return
        raise OutputError(f"{path} already holds {what} written by jaxllm; pass --overwrite "
                          f"(overwrite=True) to replace it, or choose a new output")
    raise OutputError(f"{path} is not empty and was not written by jaxllm ({shown(entries)}); "
                      f"refusing to replace it: choose a new or empty output directory")


def _clean_stale(parent: str) -> None:
    """Put right what killed writers left in ``parent``: a replacement interrupted between its
    renames gets its previous output back; the temporaries of writers that no longer hold their
    lock go. (A temporary without a lock file beside it, from an older jaxllm, is judged by its
    writer's pid, on this machine.)"""
    import re
    temp = re.compile(r"^\.(.+)\.jaxllm-(partial|old)-(\d+)-[^/]*?(\.jaxllm-lock)?$")
    names = sorted(os.listdir(parent), key=lambda n: "-old-" not in n)  # repairs first
    for name in names:
        m = temp.match(name)
        if not m:
            continue
        target, kind, pid, is_lock = m.groups()
        full = os.path.join(parent, name)
        if is_lock:
            continue  # handled with its temporary (or below, if the temporary is gone)
        lock = full + LOCK
        if os.path.exists(lock):
            with _abandoned(lock) as free:
                if free:
                    _undo_or_remove(parent, target, kind, full)
        elif not _pid_alive(int(pid)):
            _undo_or_remove(parent, target, kind, full)
    for name in os.listdir(parent):  # lock files whose temporary is gone
        m = temp.match(name)
        if m and m.group(4) and not os.path.lexists(os.path.join(parent, name[:-len(LOCK)])):
            with _abandoned(os.path.join(parent, name)) as free:
                if free:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(parent, name))


@contextlib.contextmanager
def _abandoned(lock: str):
    """Yields whether the lock at ``lock`` is free (its writer is gone), holding it meanwhile."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
        with contextlib.suppress(OSError):
            os.unlink(lock)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True


def _undo_or_remove(parent: str, target: str, kind: str, full: str) -> None:
    """An abandoned temporary: an ``old`` one holding the previous output (``m``) while the
    target is missing is a replacement killed between its renames, so the previous output goes
    back; anything else is removed."""
    previous = os.path.join(full, "m")
    dest = os.path.join(parent, target)
    if kind == "old" and os.path.lexists(previous) and not os.path.lexists(dest):
        with contextlib.suppress(OSError):
            os.rename(previous, dest)
    _remove(full)


@contextlib.contextmanager
def atomic_dir(path: str, overwrite: bool = False, sources=(),
               ours: Callable[[str], bool] = lambda name: False, what: str = "a model"):
    """Yield a temporary directory next to ``path``; on success it replaces ``path`` (the old
    one is deleted only after the rename, and only when it still holds nothing but its own
    entries), on failure it is removed and ``path`` is untouched.

    ``path`` is checked by :func:`check_output_dir` first. The temporary directory is named
    ``.NAME.jaxllm-partial-PID-*``; those of killed writers are removed on the next write."""
    check_output_dir(path, overwrite, sources, ours, what)
    path = os.path.abspath(path)
    parent = _make_parent(path)
    _clean_stale(parent)
    name = os.path.basename(path)
    with _locked_temp(parent, f".{name}.jaxllm-partial-{os.getpid()}-", path, True) as tmp:
        with _removed_on_failure(tmp, path):
            yield tmp
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write("written by jaxllm; `--overwrite` may replace this directory\n")
            _as_umask_allows(tmp)
        _into_place(tmp, path, parent, name, ours)


def _into_place(tmp: str, path: str, parent: str, name: str, ours) -> None:
    """Rename the finished ``tmp`` to ``path``; an existing output of ours is moved aside into
    a locked ``old`` temporary first and deleted after (restored by the next write's
    :func:`_clean_stale` if this process dies between the renames)."""
    if os.path.lexists(path):
        # Again, now: files may have appeared while we wrote (another process, the user).
        appeared = (not os.path.isdir(path) or os.path.islink(path)
                    or (os.listdir(path) and not (
                        MARKER in os.listdir(path) and not foreign_entries(path, ours))))
        if appeared:
            kept = _keep_beside(tmp, path)
            raise OutputError(f"{path} changed while jaxllm wrote it (it now holds files that "
                              f"are not ours: left as they are); the new output is {kept}")
        with _locked_temp(parent, f".{name}.jaxllm-old-{os.getpid()}-", path, True) as old:
            os.rename(path, os.path.join(old, "m"))
            os.rename(tmp, path)
            shutil.rmtree(old)
    else:
        os.rename(tmp, path)


# ---- run directories -----------------------------------------------------------------------


def claim_run_dir(path: str, legacy: Callable[[str], bool] = lambda path: False,
                  sources=()) -> None:
    """Make ``path`` a run directory of ours, or confirm it is one: new or empty (the manifest
    is written first), or holding our manifest, or a run from before manifests
    (``legacy(path)``: adopted). Anything else is refused: it holds someone else's files."""
    check_not_a_source(path, sources)
    manifest = os.path.join(path, RUN_MANIFEST)
    if os.path.lexists(path) and (not os.path.isdir(path) or os.path.islink(path)):
        raise OutputError(f"the run directory {path} exists and is not a directory; choose a "
                          f"new --out")
    if os.path.isdir(path) and not os.path.exists(manifest):
        entries = sorted(os.listdir(path))
        if entries and not legacy(path):
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise OutputError(f"{path} is not empty and is not a jaxllm run directory "
                              f"({shown}); refusing to write into it: choose a new or empty "
                              f"--out")
    if os.path.exists(manifest):
        return
    try:
        os.makedirs(path, exist_ok=True)
        with open(manifest, "x") as f:
            json.dump({"written_by": "jaxllm", "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, f)
    except FileExistsError:
        return  # another process claimed it a moment ago (the run lock decides who trains)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise OutputError(f"cannot write into the run directory {path}: {_why(e)}; copy "
                              f"the run to a writable place and run it there") from None
        raise OutputError(f"cannot create the run directory {path}: {_why(e)}") from None


def check_readable_dir(path: str) -> Optional[str]:
    """A file under ``path`` this process cannot read (None when all can be)."""
    for d, dirs, files in os.walk(path):
        for name in [d] + [os.path.join(d, f) for f in files]:
            if not os.access(name, os.R_OK | (os.X_OK if os.path.isdir(name) else 0)):
                return name
    return None
