"""A FUSE file system modelling a disk with a volatile write cache, and power losses of it.

Why: a SIGKILL cannot show whether a store fsyncs (the kernel's page cache outlives the
process), so durability tests need a disk that forgets what was not synced. This one does,
deterministically: every write not yet synced is lost at a power loss, nothing synced is.

The model (``VolatileCacheFS``, run by the daemon process ``python powerloss_fs.py DURABLE
MOUNTPOINT``):

* Each file has a *durable image*, a real file under ``DURABLE`` (same relative path),
  and in the daemon's memory a *view* (what reads return: the cache is coherent) and the
  list of *pending* writes and truncations applied to the view but not to the image.
* ``fsync``/``fdatasync`` of a file replays its pending list onto the image, in order:
  everything written to the file before the sync is durable, whichever fd wrote it.
* A write through a handle opened with ``O_DSYNC`` or ``O_SYNC`` reaches the image at
  once (like a FUA write), that write only: earlier pending writes stay volatile. Linux
  follows every such write with an fsync on the same handle (``generic_write_sync``),
  which FUSE passes on without its byte range, so an fsync arriving on such a handle is
  read as that per-write sync: it makes nothing else durable. LMDB relies on exactly
  this split; traced through this file system with the LMDB 0.9.36 that py-lmdb 3.0
  bundles: with sync on, each commit writes its pages through the ``O_RDWR`` fd,
  ``fdatasync``s it, then writes the meta page through a second fd on data.mdb opened
  ``O_WRONLY|O_DSYNC``; with sync off that fd is opened but unused, and both go through
  the first fd with no sync at all.
* Namespace changes (create, mkdir, unlink, rename, rmdir) are durable at once, as on a
  file system mounted ``dirsync``; a created file is durably empty until synced. The
  model is about file data: LMDB never fsyncs a directory, and this keeps it simple.
* Reads, ``flush`` (close) and ``release`` make nothing durable.

A *power loss* (``PowerLossDisk.power_loss``) SIGKILLs the daemon, so every view and
pending list is gone with its memory, and detaches the dead mount, so the kernel's page
cache of it is gone too; ``mount`` then starts a new daemon over the durable images.

The mount keeps libfuse's defaults that matter here: no ``direct_io`` (LMDB reads its data
file through ``mmap``, which FUSE supports only through the page cache) and no writeback
cache, so every ``write(2)`` reaches the daemon before it returns and the page cache and
the daemon's views hold the same bytes.
"""

from __future__ import annotations

import ctypes.util
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["FUSE_LIBRARY", "PowerLossDisk", "VolatileCacheFS", "fuse_missing"]

#: The libfuse the daemon loads (mfusepy would take libfuse 2 first if both are
#: installed); Debian's package ``fuse3`` brings it.
FUSE_LIBRARY = "fuse3"
#: ``FUSE_CAP_WRITEBACK_CACHE`` of libfuse 3's fuse_common.h.
_FUSE_CAP_WRITEBACK_CACHE = 1 << 16
#: On Linux O_SYNC is __O_SYNC | O_DSYNC, so this bit is set for both.
_SYNC_OPEN = os.O_DSYNC
#: What ``statfs`` reports, taken from the real file system holding the durable images.
_STATVFS_FIELDS = (
    "f_bsize",
    "f_frsize",
    "f_blocks",
    "f_bfree",
    "f_bavail",
    "f_files",
    "f_ffree",
    "f_namemax",
)
MOUNT_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0


def fuse_missing() -> str | None:
    """Why FUSE cannot run here (no ``/dev/fuse``, no libfuse 3), or None if it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE in this kernel or container)"
    if ctypes.util.find_library(FUSE_LIBRARY) is None:
        return f"lib{FUSE_LIBRARY} is not installed (Debian package fuse3)"
    return None


class _File:
    """One regular file's cache: the view reads see and the writes not yet durable."""

    def __init__(self, image: Path) -> None:
        self.image = image
        self.view = bytearray(image.read_bytes())
        #: (offset, data) for a write, (length, None) for a truncation, oldest first.
        self.pending: list[tuple[int, bytes | None]] = []

    def write(self, offset: int, data: bytes) -> None:
        end = offset + len(data)
        if len(self.view) < offset:
            self.view.extend(bytes(offset - len(self.view)))
        self.view[offset:end] = data
        self.pending.append((offset, data))

    def truncate(self, length: int) -> None:
        if length < len(self.view):
            del self.view[length:]
        else:
            self.view.extend(bytes(length - len(self.view)))
        self.pending.append((length, None))

    def make_durable(self, ops: list[tuple[int, bytes | None]]) -> None:
        """Apply ``ops`` to the durable image, in order."""
        fd = os.open(self.image, os.O_WRONLY)
        try:
            for offset, data in ops:
                if data is None:
                    os.ftruncate(fd, offset)
                else:
                    os.pwrite(fd, data, offset)  # beyond the end: a hole, read as zeros
        finally:
            os.close(fd)

    def sync(self) -> None:
        self.make_durable(self.pending)
        self.pending.clear()


class VolatileCacheFS:
    """The mfusepy operations of the model described in the module docstring.

    Single-threaded (the daemon runs libfuse with ``-s``), so nothing here is locked.
    Errors are raised as ``OSError``; mfusepy answers the kernel with their errno.
    """

    use_ns = True  # mfusepy: times in integer nanoseconds

    def __init__(self, durable: Path, ready_fd: int) -> None:
        # Absolute: libfuse changes the daemon's directory to / when it starts serving.
        self._durable = durable.resolve()
        self._ready_fd = ready_fd
        self._files: dict[str, _File] = {}
        #: open handle -> (path, whether it was opened O_DSYNC/O_SYNC)
        self._handles: dict[int, tuple[str, bool]] = {}
        self._next_fh = 1

    # -- helpers ----------------------------------------------------------------------

    def _image(self, path: str) -> Path:
        return self._durable / path.lstrip("/")

    def _file(self, path: str) -> _File:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = _File(self._image(path))
        return f

    def _handle(self, path: str, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = (path, bool(flags & _SYNC_OPEN))
        if flags & os.O_TRUNC:  # the kernel passes O_TRUNC on (libfuse's atomic_o_trunc)
            self._file(path).truncate(0)
        return fh

    # -- life cycle -------------------------------------------------------------------

    def init_with_config(self, conn: Any, config: Any) -> None:
        """Turn the writeback cache off (it is off by default; this makes it certain),
        check that nothing bypasses the page cache, then tell the parent we are up."""
        conn.want &= ~_FUSE_CAP_WRITEBACK_CACHE
        if config is not None and (config.direct_io or config.kernel_cache):
            raise RuntimeError("the mount must not use direct_io or kernel_cache")
        os.write(self._ready_fd, b"ready\n")

    # -- attributes and directories ---------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._image(path))
        size = st.st_size
        if stat.S_ISREG(st.st_mode) and path in self._files:
            size = len(self._files[path].view)
        return {
            "st_mode": st.st_mode,
            "st_nlink": st.st_nlink,
            "st_size": size,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns,
            "st_ctime": st.st_ctime_ns,
        }

    def access(self, path: str, amode: int) -> int:
        os.lstat(self._image(path))
        return 0

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._image(path))]

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._durable)
        return {k: getattr(sv, k) for k in _STATVFS_FIELDS}

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._image(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._image(path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._image(path))
        self._files.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._image(old), self._image(new))
        moved = self._files.pop(old, None)
        self._files.pop(new, None)
        if moved is not None:
            moved.image = self._image(new)
            self._files[new] = moved
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._image(path), stat.S_IMODE(mode))
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0  # ownership is not modelled

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        return 0  # times are not modelled

    # -- files ------------------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int) -> int:
        fd = os.open(self._image(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IMODE(mode))
        os.close(fd)
        return self._handle(path, flags)

    def open(self, path: str, flags: int) -> int:
        self._file(path)  # fails with ENOENT if the image is missing
        return self._handle(path, flags)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return bytes(self._file(path).view[offset : offset + size])

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        f = self._file(path)
        f.write(offset, data)
        if self._handles[fh][1]:
            f.make_durable([(offset, data)])
        return len(data)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._file(path).truncate(length)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        if not self._handles[fh][1]:  # see the module docstring for O_DSYNC handles
            self._file(path).sync()
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close(2) does not sync

    def release(self, path: str, fh: int) -> int:
        del self._handles[fh]
        return 0


def _serve(durable: Path, mountpoint: Path) -> None:
    """The daemon: mount the model in the foreground until killed or unmounted."""
    os.environ["FUSE_LIBRARY_NAME"] = FUSE_LIBRARY
    import mfusepy  # type: ignore[import-untyped]  # ctypes bindings, no type information

    ops = VolatileCacheFS(durable, sys.stdout.fileno())
    # foreground, one thread (the model is not locked); default cache options (above).
    mfusepy.FUSE(ops, str(mountpoint), foreground=True, nothreads=True, fsname="powerloss")


class PowerLossDisk:
    """A ``VolatileCacheFS`` over ``root/durable``, mounted at ``root/mnt`` by a daemon
    process; ``power_loss`` then ``mount`` models the machine losing power and booting.

    Use as a context manager: ``__exit__`` kills the daemon and detaches the mount.
    Processes using files under the mount must be gone (or have closed them) before a
    power loss or the exit: files of a dead mount fail with ENOTCONN.
    """

    def __init__(self, root: Path) -> None:
        root.mkdir(exist_ok=True)
        self.durable = root.resolve() / "durable"
        self.mountpoint = root.resolve() / "mnt"
        self.durable.mkdir(exist_ok=True)
        self.mountpoint.mkdir(exist_ok=True)
        self._daemon: subprocess.Popen[bytes] | None = None
        self._log = root / "daemon.log"

    def mount(self) -> None:
        """Start a daemon over the durable images; return once the mount serves requests."""
        assert self._daemon is None, "already mounted"
        with open(self._log, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, str(self.durable), str(self.mountpoint)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._daemon = proc
        assert proc.stdout is not None
        line = b""
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                break
            chunk = os.read(proc.stdout.fileno(), 64)
            if not chunk:
                break
            line += chunk
        if line != b"ready\n" or not _mounted(self.mountpoint):
            self.power_loss()
            raise RuntimeError(
                f"FUSE daemon did not mount ({line!r}):\n{self._log.read_text(errors='replace')}"
            )

    def power_loss(self) -> None:
        """Lose every write not yet durable: SIGKILL the daemon (its memory holds them),
        then detach the dead mount (the kernel's cache of it goes with it)."""
        proc, self._daemon = self._daemon, None
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(STOP_TIMEOUT)
            if proc.stdout is not None:
                proc.stdout.close()
        if _mounted(self.mountpoint):
            _detach(self.mountpoint)

    def daemon_log(self) -> str:
        """What the daemons wrote to stderr (mfusepy logs failed operations there)."""
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def __enter__(self) -> PowerLossDisk:
        self.mount()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.power_loss()


def _mounted(mountpoint: Path) -> bool:
    """Whether something is mounted at ``mountpoint`` (``os.path.ismount`` stats the
    mount's root, which fails on a mount whose daemon is dead)."""
    target = str(mountpoint.resolve())
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def _detach(mountpoint: Path) -> None:
    """Lazily unmount a FUSE mount whose daemon is dead (fusermount3 works unprivileged)."""
    if shutil.which("fusermount3"):
        argv = ["fusermount3", "-u", "-z", str(mountpoint)]
    else:
        argv = ["umount", "-l", str(mountpoint)]
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, capture_output=True)


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), Path(sys.argv[2]))
