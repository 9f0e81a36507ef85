"""`crihook serve` as kubelet meets it: a real daemon process in front of a runtime socket; or, with
`nri_socket`, `crihook nri` as the runtime's NRI plugin (kubelet then talks to the runtime itself).

`crihook demo` and the tests start it with `running_crihook(backend, work_dir, config=...)` (or the
`crihook_proxy` fixture) and talk CRI to `proxy.address`, which in NRI mode is the runtime's. The
daemon runs as its own process with uvloop, signals and the systemd notify protocol, exactly as
under systemd; its log is kept for the failure message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


class CrihookError(RuntimeError):
    pass


@dataclass
class Crihook:
    work: Path
    backend: str  # unix:///path of the runtime
    config_text: str = ""  # extra TOML appended to the generated [proxy] table
    env: dict[str, str] = field(default_factory=dict)
    nri_socket: Path | None = None  # NRI mode: `crihook nri` registers with the runtime there
    metrics_listen: str = ""  # host:port of the metrics endpoint; empty: none
    # run before the daemon's own command (which it must exec): a sandbox, as a unit's would be
    prefix: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    notify_socket: socket.socket | None = field(default=None, repr=False)

    @property
    def socket_path(self) -> Path:
        return self.work / "run" / "crihook.sock"

    @property
    def address(self) -> str:
        """Where kubelet's calls go: crihook's socket, or in NRI mode the runtime's."""
        return self.backend if self.nri_socket is not None else f"unix://{self.socket_path}"

    @property
    def mode(self) -> str:
        return "proxy" if self.nri_socket is None else "nri"

    @property
    def state_dir(self) -> Path:
        return self.work / "state"

    @property
    def config_path(self) -> Path:
        return self.work / "crihook.toml"

    @property
    def log_path(self) -> Path:
        return self.work / "crihook.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def write_config(self, extra: str | None = None) -> None:
        if extra is not None:
            self.config_text = extra
        proxy = (
            "[proxy]\n"
            f'listen = "unix://{self.socket_path}"\n'
            f'state_dir = "{self.state_dir}"\n'
            f'metrics_listen = "{self.metrics_listen}"\n'
            "connect_timeout_seconds = 20.0\n"
            "drain_seconds = 5.0\n"
            'log_level = "debug"\n'
        )
        self.work.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(proxy + "\n" + self.config_text)

    def start(self, timeout: float = 30.0) -> None:
        """Start the daemon and return once it told systemd READY=1 (store rebuilt, socket bound; in
        NRI mode: registered with the runtime and synchronized)."""
        if self.pid is not None:
            raise CrihookError(f"crihook already runs as pid {self.pid}")
        (self.work / "run").mkdir(mode=0o755, parents=True, exist_ok=True)
        if not self.config_path.exists():
            self.write_config()
        notify_path = self.work / "notify.sock"
        notify_path.unlink(missing_ok=True)
        self.notify_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify_socket.bind(str(notify_path))
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(notify_path)}
        # the runtime's CRI socket is a [node] key, and the tests' own text may hold a [node] table
        command = ["serve", "--config", str(self.config_path), "--runtime-endpoint", self.backend]
        if self.nri_socket is not None:
            command = ["nri", *command[1:], "--nri-socket", str(self.nri_socket)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "crihook.cli", *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.wait_notify("READY=1", timeout)

    def wait_notify(self, what: str, timeout: float) -> None:
        assert self.notify_socket is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise CrihookError(f"crihook exited during start:\n{self.log_tail()}")
            self.notify_socket.settimeout(0.1)
            try:
                message = self.notify_socket.recv(4096).decode()
            except TimeoutError:
                continue
            if what in message.split("\n"):
                return
        raise CrihookError(f"crihook did not send {what} within {timeout}s:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, kill: bool = False, timeout: float = 30.0) -> int | None:
        """SIGTERM (or SIGKILL to play a crash) by pid; returns the exit status."""
        if self.process is None:
            return None
        self.signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            rc = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            rc = self.process.wait()
        self.process = None
        if self.notify_socket is not None:
            self.notify_socket.close()
            self.notify_socket = None
        return rc

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory of the daemon, from /proc."""
        assert self.pid is not None
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise CrihookError("no VmRSS in /proc status")


@contextmanager
def running_crihook(
    backend: str, work: Path, config: str = "", env: dict[str, str] | None = None, nri_socket: Path | None = None
) -> Iterator[Crihook]:
    """A started crihook in `work` forwarding to `backend` (or, with `nri_socket`, the runtime's NRI
    plugin); stopped (by its pid) on exit."""
    proxy = Crihook(work, backend, config, dict(env or {}), nri_socket)
    proxy.write_config()
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
