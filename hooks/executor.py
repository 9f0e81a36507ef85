"""The worker threads blocking hooks run on, built for hooks that may hang (`DaemonThreads`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class DaemonThreads(Executor):
    """ThreadPoolExecutor's job, with two differences a hook pool needs. Its threads are daemons:
    Python joins a pool's threads at exit, and a hook (or a file system) that never returns must not
    keep crihook from stopping. And a thread stuck in a hook past its timeout can be written off (`write_off`): the pool
    may start another in its place, and the stuck one leaves when (if ever) its job returns."""

    def __init__(self, size: int, name: str = "crihook-hook") -> None:
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[
            tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None
        ] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads = 0
        self._shut = False
        self._local = threading.local()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("hook threads are shut down")
            self._jobs.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and self._threads < self._size:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
        return future

    def write_off(self) -> None:
        """Called from the event loop about a job that outlived its timeout: its thread no longer
        counts towards the pool's size."""
        with self._lock:
            self._size += 1

    def leave_after_job(self) -> None:
        """Called by a written-off job when it finally returns: its thread goes instead of idling."""
        self._local.leave = True

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:
                    future.set_exception(e)
            if getattr(self._local, "leave", False):
                with self._lock:
                    self._size -= 1
                    self._threads -= 1
                return
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            for _ in range(self._threads):
                self._jobs.put(None)
