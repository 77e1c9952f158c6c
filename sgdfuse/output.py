"""Writing output files whole or not at all, several at once.

Every file sgdfuse writes (fused model, report, ``.air``, init graph, JSON, plugin source) goes through
:class:`OutputBatch`: each file is first written in full to a temporary file beside its destination; only when
every file of the batch is staged are they renamed into place. A failure while staging leaves nothing behind.
A destination that is a symbolic link is written through (its target is replaced); one that exists and is not
a regular file (a device such as ``/dev/null``, a pipe, a socket) is refused rather than replaced, since
``rename`` would swap the device for a plain file. Two outputs of one batch naming the same file are refused.

Data files whose names come from a model file (external data, untrusted) are staged with
:meth:`OutputBatch.stage_copy`, which follows no symbolic link and never leaves the output's directory.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterable

from sgdfuse.errors import OutputWriteError

__all__ = ["OutputBatch", "resolve_destination", "write_bytes"]


def resolve_destination(path: str | os.PathLike) -> str:
    """The file that writing ``path`` replaces: symlinks followed, checked to be writable as a regular file.

    Raises:
        OutputWriteError: the directory does not exist (or a part of its path is a file) or is not writable, ``path`` is a directory, or it exists and is not a
            regular file.
    """
    shown = os.fspath(path)
    target = os.path.realpath(shown)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise OutputWriteError(shown, _missing_directory(directory))
    if os.path.isdir(target):
        raise OutputWriteError(shown, "is a directory; give a file name")
    if not os.access(directory, os.W_OK | os.X_OK):
        # The file is written beside its target and renamed over it: the directory must take new entries.
        raise OutputWriteError(shown, f"directory {directory} is not writable; give a path in a directory you can write")
    if os.path.lexists(target):
        mode = os.stat(target).st_mode
        if not stat.S_ISREG(mode):
            raise OutputWriteError(shown, "exists and is not a regular file (a device, pipe or socket); give a file path")
    return target


def _missing_directory(directory: str) -> str:
    """Why ``directory`` cannot hold a file: the nearest existing ancestor is a file, or it does not exist."""
    ancestor = directory
    while ancestor and not os.path.lexists(ancestor):
        parent = os.path.dirname(ancestor)
        if parent == ancestor:
            break
        ancestor = parent
    if ancestor and os.path.lexists(ancestor) and not os.path.isdir(ancestor):
        return f"{ancestor} is a file, not a directory; give a path in a directory"
    return f"directory {directory} does not exist; create it first"


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class OutputBatch:
    """Stage files, then commit them together. Use as a context manager: leaving the block without
    :meth:`commit` (an exception) removes whatever was staged.

    Example::

        with OutputBatch() as batch:
            batch.stage("model.onnx", model_bytes)
            batch.stage("report.json", report_bytes)
            batch.commit()
    """

    def __init__(self) -> None:
        self._staged: list[tuple[str, str, str]] = []  # (temporary, target, path as given)
        self._targets: set[str] = set()
        self._made_directories: list[str] = []  # by stage_copy, removed again on abort
        self._committed = False

    def __enter__(self) -> "OutputBatch":
        return self

    def __exit__(self, *exc) -> None:
        if not self._committed:
            self.abort()

    def stage(self, path: str | os.PathLike, data: bytes) -> None:
        """Write ``data`` in full to a temporary file beside ``path``.

        Raises:
            OutputWriteError: ``path`` cannot be written (see :func:`resolve_destination`) or the write failed.
        """
        shown = os.fspath(path)
        target = resolve_destination(shown)
        self._claim(target, shown)

        def fill(descriptor: int) -> None:
            with os.fdopen(os.dup(descriptor), "wb") as handle:
                handle.write(data)

        self._stage_via(target, shown, fill)

    def stage_text(self, path: str | os.PathLike, pieces: Iterable[str]) -> None:
        """Write the UTF-8 encoding of the strings ``pieces`` in full to a temporary file beside ``path``, one
        after another (a large text is never held whole).

        Raises:
            OutputWriteError: as :meth:`stage`.
        """
        shown = os.fspath(path)
        target = resolve_destination(shown)
        self._claim(target, shown)

        def fill(descriptor: int) -> None:
            with os.fdopen(os.dup(descriptor), "w", encoding="utf-8", newline="", buffering=1 << 20) as handle:
                for piece in pieces:
                    handle.write(piece)

        self._stage_via(target, shown, fill)

    def stage_copy(self, path: str | os.PathLike, source: int, *, within: str | os.PathLike) -> None:
        """Stage a copy of the whole regular file open at descriptor ``source`` at ``path``, a name that came
        from a model file (an external data file): it must lie inside the directory ``within``, and no
        symbolic link on the way or at ``path`` is followed. Missing directories inside ``within`` are made
        (and removed again if the batch is not committed). A file already at ``path`` with the same bytes is
        left as it is; one with other bytes is refused, not replaced.

        Raises:
            OutputWriteError: ``path`` leaves ``within``, passes a symbolic link or a non-directory, is taken by
                another file or by another output of the batch, or the copy failed.
        """
        shown = os.fspath(path)
        root = os.path.realpath(os.fspath(within))
        target = os.path.normpath(os.path.join(root, shown))
        if os.path.commonpath([root, target]) != root or target == root:
            raise OutputWriteError(shown, f"is outside the output directory {root}; not written")
        self._claim(target, shown)  # also when an identical file is already there: no other output may replace it
        self._make_parents(root, target, shown)
        if os.path.lexists(target):
            info = os.lstat(target)
            if stat.S_ISLNK(info.st_mode):
                raise OutputWriteError(shown, "is a symbolic link; a data file is never written through a link")
            if not stat.S_ISREG(info.st_mode):
                raise OutputWriteError(shown, "exists and is not a regular file; write the model elsewhere")
            if _same_contents(source, target):
                return
            raise OutputWriteError(shown, "already exists with other contents; write the model elsewhere")
        self._stage_via(target, shown, lambda descriptor: _copy(source, descriptor))

    def _claim(self, target: str, shown: str) -> None:
        if target in self._targets:
            raise OutputWriteError(shown, "is named twice among the files to write (two outputs would be one file)")
        self._targets.add(target)

    def _make_parents(self, root: str, target: str, shown: str) -> None:
        directory = root
        for part in os.path.relpath(os.path.dirname(target), root).split(os.sep):
            if part in ("", "."):
                continue
            directory = os.path.join(directory, part)
            try:
                os.mkdir(directory)
                self._made_directories.append(directory)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(directory).st_mode):  # lstat: a link to a directory is refused
                    raise OutputWriteError(shown, f"{directory} is not a directory (or is a symbolic link); not written")
            except OSError as error:
                raise OutputWriteError(shown, f"cannot make {directory}: {error.strerror or error}") from error

    def _stage_via(self, target: str, shown: str, fill) -> None:
        """Write a temporary file beside ``target`` with ``fill(descriptor)`` and record it for commit."""
        directory = os.path.dirname(target)
        temporary = None
        try:
            descriptor, temporary = tempfile.mkstemp(prefix=".sgdfuse-", suffix=".tmp", dir=directory)
            try:
                fill(descriptor)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            # mkstemp creates 0600: an existing file keeps its mode, a new one gets the usual 0666 less umask.
            existing = os.path.exists(target) and not os.path.islink(target)
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode) if existing else _default_mode())
        except BaseException as error:  # also an error of what ``fill`` writes (stage_text's pieces), or ^C
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)
            if isinstance(error, OSError):
                raise OutputWriteError(shown, f"cannot write in {directory}: {error.strerror or error}") from error
            raise
        self._staged.append((temporary, target, shown))

    def commit(self) -> None:
        """Rename every staged file into place.

        Raises:
            OutputWriteError: a rename failed; files not yet renamed are removed.
        """
        for index, (temporary, target, shown) in enumerate(self._staged):
            try:
                os.replace(temporary, target)
            except OSError as error:
                self._staged = self._staged[index:]
                self.abort()
                raise OutputWriteError(shown, f"write failed: {error.strerror or error}") from error
        self._staged = []
        self._made_directories = []
        self._committed = True

    def abort(self) -> None:
        """Remove every staged temporary file."""
        for temporary, _, _ in self._staged:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        self._staged = []
        for directory in reversed(self._made_directories):
            try:
                os.rmdir(directory)
            except OSError:
                pass
        self._made_directories = []


def _copy(source: int, destination: int) -> None:
    """Copy the whole file at descriptor ``source`` to ``destination`` in the kernel (``sendfile``), through
    Python only where the kernel cannot."""
    size, position = os.fstat(source).st_size, 0
    try:
        while position < size:
            sent = os.sendfile(destination, source, position, min(size - position, 1 << 30))
            if sent == 0:
                break
            position += sent
        return
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or position:
            raise
    while True:
        chunk = os.pread(source, 1 << 20, position)
        if not chunk:
            return
        view = memoryview(chunk)
        while view:
            view = view[os.write(destination, view):]
        position += len(chunk)


def _same_contents(source: int, path: str) -> bool:
    """True when the file at ``path`` holds exactly the bytes of the file at descriptor ``source``."""
    if os.fstat(source).st_size != os.path.getsize(path):
        return False
    with open(path, "rb") as other:
        position = 0
        while True:
            chunk = os.pread(source, 1 << 20, position)
            if chunk != other.read(1 << 20):
                return False
            if not chunk:
                return True
            position += len(chunk)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write one file whole or not at all (an :class:`OutputBatch` of one)."""
    with OutputBatch() as batch:
        batch.stage(path, data)
        batch.commit()
