"""Writing output files whole or not at all, several at once.

Every file sgdfuse writes (fused model, report, ``.air``, init graph, JSON, plugin source) goes through
:class:`OutputBatch`: each file is first written in full to a temporary file beside its destination; only when
every file of the batch is staged are they renamed into place. A failure while staging leaves nothing behind.
A destination that is a symbolic link is written through (its target is replaced); one that exists and is not
a regular file (a device such as ``/dev/null``, a pipe, a socket) is refused rather than replaced, since
``rename`` would swap the device for a plain file.
"""

from __future__ import annotations

import os
import stat
import tempfile

from sgdfuse.errors import OutputWriteError

__all__ = ["OutputBatch", "resolve_destination", "write_bytes"]


def resolve_destination(path: str | os.PathLike) -> str:
    """The file that writing ``path`` replaces: symlinks followed, checked to be writable as a regular file.

    Raises:
        OutputWriteError: the directory does not exist, ``path`` is a directory, or it exists and is not a
            regular file.
    """
    shown = os.fspath(path)
    target = os.path.realpath(shown)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise OutputWriteError(shown, f"directory {directory} does not exist")
    if os.path.isdir(target):
        raise OutputWriteError(shown, "is a directory; give a file name")
    if os.path.lexists(target):
        mode = os.stat(target).st_mode
        if not stat.S_ISREG(mode):
            raise OutputWriteError(shown, "exists and is not a regular file (a device, pipe or socket); give a file path")
    return target


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
        directory = os.path.dirname(target)
        temporary = None
        try:
            descriptor, temporary = tempfile.mkstemp(prefix=".sgdfuse-", suffix=".tmp", dir=directory)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            # mkstemp creates 0600: an existing file keeps its mode, a new one gets the usual 0666 less umask.
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target) else _default_mode())
        except OSError as error:
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)
            raise OutputWriteError(shown, f"cannot write in {directory}: {error.strerror or error}") from error
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
        self._committed = True

    def abort(self) -> None:
        """Remove every staged temporary file."""
        for temporary, _, _ in self._staged:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        self._staged = []


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write one file whole or not at all (an :class:`OutputBatch` of one)."""
    with OutputBatch() as batch:
        batch.stage(path, data)
        batch.commit()
