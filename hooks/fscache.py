"""Answers to a hook's file-system questions, kept until the kernel says they may have changed.

A hook that reads files (the kubelet checkpoint, device nodes, kubelet's pod directories) can not
run on the event loop: one read on a stalled file system would freeze every CRI call. But the same
questions get the same answers call after call. `FsMemo` remembers each answer together with an
inotify watch on the directory it came from; reading the inotify queue is a non-blocking read of a
kernel buffer that touches no file system, so the event loop can ask "did anything I rely on
change?" safely. A hook's `handle_cached` (hooks.base.Recalls) answers from the memo on the loop;
`recall` raises `NotCached` for anything the memo does not hold, from however deep in the hook's
decision it was asked, and the hook answers MISS: `handle` then does the real reads on a worker
thread and fills the memo.

inotify events are queued by the kernel inside the syscall that makes the change, so once kubelet's
write or rename of a file returned, the next `sync` sees it: an answer is never used after a change
kubelet made before sending the call. A directory that does not exist (yet) is answered for too:
its nearest existing ancestor is watched for the name on the way down, so kubelet creating it (crihook
starts first; a node without kubelet never has it) drops what was said about it. Where inotify is
unavailable (no watches left, a file system that does not support it) nothing is remembered and every
call takes the worker thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import select
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

# <sys/inotify.h>
IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_MASK_ADD = 0x20000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# which names a directory holds: enough for "does this path exist"
ENTRIES = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
# and what the files hold: for a file read whole (written in place or replaced by rename)
CONTENTS = ENTRIES | IN_CLOSE_WRITE | IN_MODIFY | IN_ATTRIB
# or their inodes: a device node's numbers and mode (not the writes to it, which are many in /dev)
INODES = ENTRIES | IN_ATTRIB
_SELF = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
_EVENT = struct.Struct("iIII")


class NotCached(Exception):
    """The answer needs a file-system read: the hook that asked answers MISS (hooks.base.Recalls)."""


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):
        return None


# a hook asks about the same dozen paths on every call: their split is remembered
_split = functools.lru_cache(maxsize=4096)(os.path.split)


class FsMemo:
    """Answers keyed by the path they depend on, each dropped when its directory reports a change
    to that name (or to the directory itself). Thread-safe: the worker thread fills it, the event
    loop reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libc = _libc()
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC) if self._libc is not None else -1
        self._fd: int | None = fd if fd >= 0 else None
        # a memo dropped without close() (a chain built and forgotten) still gives its descriptor back
        self._finalizer = weakref.finalize(self, os.close, fd) if fd >= 0 else None
        # asks the kernel whether any event is queued, without a read that fails when none is
        self._queued = select.poll()
        if fd >= 0:
            self._queued.register(fd, select.POLLIN)
        self._wd: dict[str, int] = {}  # directory -> watch descriptor
        self._mask: dict[str, int] = {}  # directory -> events asked for
        self._dirs: dict[int, str] = {}
        self._generation: dict[str, int] = {}  # directory -> changes seen, to spot a change mid-read
        # a missing directory -> (its nearest watched ancestor, the name there on the way to it), and
        # back: what appears or goes under that name may change every answer about the directory
        self._missing: dict[str, tuple[str, str]] = {}
        self._waiting: dict[tuple[str, str], set[str]] = {}
        self._memo: dict[tuple[str, str], tuple[Any, BaseException | None]] = {}  # (dir, name) -> answer

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()  # closes the descriptor, once
            self._fd = None
            self._memo.clear()

    def sync(self) -> None:
        """Drop every answer the kernel has reported a change for. Never blocks on a file system."""
        if self._fd is None:
            return
        try:
            if not self._queued.poll(0):
                return
        except RuntimeError:  # another thread polls this very moment: read the queue as before
            pass
        with self._lock:
            self._drain()

    def version(self, directory: str) -> int | None:
        """How many changes the kernel has reported in `directory` (as of the last `sync`), or None
        when it is not watched: what was worked out from answers about the directory recalled after
        the count was n still holds while it is n."""
        if directory not in self._wd:
            return None
        return self._generation.get(directory, 0)

    def recall(self, path: str) -> Any:
        """The remembered answer about `path` (re-raising a remembered error). Raises NotCached.
        Call `sync` first, once per call of the hook."""
        hit = self._memo.get(_split(path))
        if hit is None:
            raise NotCached(path)
        value, error = hit
        if error is not None:
            raise error
        return value

    def answer(self, path: str, compute: Callable[[], _T], contents: bool = False, inode: bool = False) -> _T:
        """compute() (which may block: worker threads only), remembered for `path` if the kernel can
        tell us when it changes. `contents`: the answer depends on what the file holds, not only on
        whether it is there; `inode`: on its stat (numbers, mode, owner), not on what it holds."""
        head, name = _split(path)
        generation = self._watch(head, CONTENTS if contents else INODES if inode else ENTRIES)
        try:
            value = compute()
        except Exception as e:
            self._keep(head, name, generation, (None, e))
            raise
        self._keep(head, name, generation, (value, None))
        return value

    # -- inside --------------------------------------------------------------------------------

    def _watch(self, directory: str, mask: int) -> int | None:
        """The directory's change count once it is watched for `mask`; None if it can not be. The
        lock is not held while the kernel looks the path up (that may stall: the loop must not wait)."""
        fd = self._fd
        if fd is None:
            return None
        with self._lock:
            have = self._mask.get(directory, 0)
            generation = self._generation.get(directory, 0)
        if have & mask != mask:
            wd = self._add_watch(fd, directory, mask)
            if wd in (-errno.ENOENT, -errno.ENOTDIR):
                return self._watch_missing(fd, directory, mask)
            if wd < 0:
                return None
        return generation

    def _add_watch(self, fd: int, directory: str, mask: int) -> int:
        """The watch descriptor, or minus errno for a directory that can not be watched."""
        wd: int = self._libc.inotify_add_watch(fd, os.fsencode(directory), mask | IN_MASK_ADD)
        if wd < 0:
            err = ctypes.get_errno()
            if err not in (errno.ENOENT, errno.ENOTDIR, errno.ENOSPC, errno.EACCES, errno.EBADF):
                raise OSError(err, os.strerror(err), directory)
            return -err
        with self._lock:
            self._wd[directory] = wd
            self._dirs[wd] = directory
            self._mask[directory] = self._mask.get(directory, 0) | mask
        return wd

    def _watch_missing(self, fd: int, directory: str, mask: int) -> int | None:
        """`directory` does not exist: its nearest existing ancestor is watched for the name on the
        way down, and that name is looked at once the watch is set: still no directory, its making will
        be reported; made meanwhile, the directory itself is tried again."""
        for _ in range(3):
            below = directory
            while True:
                above = os.path.dirname(below)
                if above == below or not above:
                    return None
                wd = self._add_watch(fd, above, ENTRIES)
                if wd >= 0:
                    break
                if wd not in (-errno.ENOENT, -errno.ENOTDIR):
                    return None
                below = above
            name = os.path.basename(below)
            with self._lock:
                self._missing[directory] = (above, name)
                self._waiting.setdefault((above, name), set()).add(directory)
                generation = self._generation.get(directory, 0)
            if not os.path.isdir(below):
                return generation
            wd = self._add_watch(fd, directory, mask)
            if wd >= 0:
                return generation
            if wd not in (-errno.ENOENT, -errno.ENOTDIR):
                return None
        return None

    def _keep(self, head: str, name: str, generation: int | None, answer: tuple[Any, BaseException | None]) -> None:
        if generation is None:
            return
        with self._lock:
            self._drain()  # a change made while compute() ran is counted before we compare
            if self._generation.get(head, 0) == generation and (head in self._wd or head in self._missing):
                self._memo[(head, name)] = answer

    def _drain(self) -> None:
        assert self._fd is not None
        while True:
            try:
                buf = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            pos = 0
            while pos + _EVENT.size <= len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                name = buf[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0")
                pos += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    self._forget_all()
                    continue
                directory = self._dirs.get(wd)
                if directory is None:
                    continue
                self._generation[directory] = self._generation.get(directory, 0) + 1
                if mask & _SELF or not name:
                    self._forget_dir(wd, directory, unwatch=bool(mask & _SELF))
                    for key in [k for k in self._waiting if k[0] == directory]:
                        self._appeared(key)
                else:
                    self._memo.pop((directory, os.fsdecode(name)), None)
                    if self._waiting:
                        self._appeared((directory, os.fsdecode(name)))

    def _forget_dir(self, wd: int, directory: str, unwatch: bool) -> None:
        for key in [k for k in self._memo if k[0] == directory]:
            del self._memo[key]
        if unwatch:  # gone or moved: watched afresh, by path, on the next real read
            self._dirs.pop(wd, None)
            self._wd.pop(directory, None)
            self._mask.pop(directory, None)
            if self._libc is not None and self._fd is not None:
                self._libc.inotify_rm_watch(self._fd, wd)

    def _appeared(self, key: tuple[str, str]) -> None:
        """A name on the way to missing directories changed: their answers go, and the next real
        read watches them afresh."""
        for directory in self._waiting.pop(key, ()):
            self._generation[directory] = self._generation.get(directory, 0) + 1
            self._missing.pop(directory, None)
            for k in [k for k in self._memo if k[0] == directory]:
                del self._memo[k]

    def _forget_all(self) -> None:
        self._memo.clear()
        for directory in [*self._wd, *self._missing]:
            self._generation[directory] = self._generation.get(directory, 0) + 1
        self._missing.clear()
        self._waiting.clear()
