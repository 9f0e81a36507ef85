"""A private containerd for `crihook demo` and the tests: offline OCI images and a daemon that shares
nothing with the machine's own, in a temporary directory.

Three containerd releases, named by `Runtime.name`:
- "1.6": the machine's own (Debian bookworm's containerd 1.6.20, on PATH). No CDI.
- "1.7": Debian trixie's containerd 1.7.x; "2": Debian sid's containerd 2.x (sid moves: never pinned).
  `tests/runtimes.sh` (run by tests/run.sh) downloads and extracts them into a cache outside git
  (`runtimes_dir()`); a release it could not download is skipped with its reason
  (`Runtime.unavailable()`), one that downloads but does not run fails its tests.
Every release uses bookworm's runc (trixie's and sid's need a newer glibc). 1.7 and 2.x run with CDI
on and one spec dir of their own, `Containerd.cdi_spec_dir`; nothing else is searched. They also run
with NRI on (`Containerd.nri`), its socket, plugin and plugin-config dirs private
(`Containerd.nri_socket`, `nri_plugin_dir`, `nri_plugin_config_dir`): with no plugin connected the
runtime behaves as without NRI, which is 2.x's default anyway.

The tests' fixtures and how a test picks a release are in tests/support/containerd.py. containerd
re-reads its CDI spec dir on every injection, so a spec written before CreateContainer applies.

Nothing here talks to a registry. The two images are OCI archives written by this module (a pause
image from `pause.c` built with `gcc -static`, a busybox image from Debian's busybox-static), cached
outside the package and imported with `ctr images import`; nothing may call PullImage, because
containerd 1.6 contacts the registry on PullImage even for an image it already has.

Facts about the machines this runs on (Debian 12, runc 1.1.5), learned by trying:
- Root, but no CAP_SYS_RESOURCE in the bounding set: runc cannot lower oom_score_adj, and without
  `restrict_oom_score_adj` every RunPodSandbox fails with "can't get final child's PID from pipe: EOF".
- cgroup v1 controllers with a v2 tree at /sys/fs/cgroup/unified (hybrid); runc's cgroupfs driver
  works, so no systemd is needed. runc removes a container's cgroup, never the pod's parent.
- overlayfs works on the root ext4, so the default overlayfs snapshotter does.
- Pods use the host network namespace, so no CNI plugin or config is needed; CRI logs that it has
  no CNI config and carries on. Such a pod may not set a hostname (runc refuses without its own UTS
  namespace), which is why kubelet leaves it empty for host-network pods and so does cri.py.
- containerd 1.6 has no CDI support (that came in 1.7): `CDI_devices` in a CreateContainer reaches
  containerd and is ignored.
- Beside another containerd, each instance needs its own runc root (the default
  /run/containerd/runc/k8s.io is shared), NRI off or on a socket of its own (the default
  /var/run/nri/nri.sock is shared, and so are /opt/nri/plugins and /etc/nri/conf.d), and on 1.7/2.x
  the shim named by `runtime_path`: 2.x otherwise finds the machine's 1.6 shim on PATH and silently
  uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc

import crihook.base.oci
from crihook.base.oci import LayerFile, layer_tar, oci_archive
from crihook.proto.wire import length_delimited
from crihook.simnode.fakenvml import cache_dir

PAUSE_SOURCE = Path(__file__).resolve().parent / "pause.c"

NAMESPACE = "k8s.io"  # the containerd namespace CRI works in
# Pods get cgroup parents below this (kubelet would use /kubepods/...). One root per process, so
# cleanup removes exactly this process's cgroups and never races another one creating its own.
CGROUP_ROOT = f"/crihook-private-{os.getpid()}"
PAUSE_IMAGE = "localhost/crihook/pause:test"
BUSYBOX_IMAGE = "localhost/crihook/busybox:test"

# Everything a private containerd needs, as (executable, Debian package).
REQUIRED_TOOLS = (
    ("containerd", "containerd"),
    ("containerd-shim-runc-v2", "containerd"),
    ("ctr", "containerd"),
    ("runc", "runc"),
    ("busybox", "busybox-static"),
    ("gcc", "gcc"),
)


_PT_INTERP = 3


class ContainerdError(RuntimeError):
    """containerd did not come up, or a ctr command failed; the message carries its output."""


def missing_requirements() -> str | None:
    """Why a private containerd can not run here, or None when it can."""
    if os.geteuid() != 0:
        return "a private containerd needs root (runc creates namespaces, cgroups and overlay mounts)"
    absent = sorted({pkg for exe, pkg in REQUIRED_TOOLS if shutil.which(exe) is None})
    if absent:
        return f"a private containerd needs the Debian packages {', '.join(absent)} (tests/run.sh installs them)"
    busybox = shutil.which("busybox")
    if busybox is not None and not is_static_elf(Path(busybox)):
        return f"{busybox} is dynamically linked; the busybox image needs busybox-static"
    return None


def is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a program interpreter, i.e. one that runs with no libc."""
    with path.open("rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only
            return False
        order: Literal["little", "big"] = "little" if head[5] == 1 else "big"
        phoff = int.from_bytes(head[32:40], order)
        phentsize = int.from_bytes(head[54:56], order)
        phnum = int.from_bytes(head[56:58], order)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    types = (int.from_bytes(table[i : i + 4], order) for i in range(0, len(table), phentsize))
    return _PT_INTERP not in types


# ---------------------------------------------------------------- offline OCI images


def _cached(name: str, inputs: Iterable[bytes], build: Callable[[], bytes]) -> Path:
    """The archive for these inputs, built once: its file name carries a hash of everything it came
    from, this module's code included."""
    key = hashlib.sha256()
    for chunk in (Path(__file__).read_bytes(), Path(crihook.base.oci.__file__).read_bytes(), *inputs):
        key.update(hashlib.sha256(chunk).digest())
    cache = cache_dir() / "images"  # outside the package, which may be installed read-only
    path = cache / f"{name}-{key.hexdigest()[:16]}.tar"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(build())
        partial.replace(path)
    return path


def pause_archive() -> Path:
    """The pause image: `/pause`, built from pause.c with `gcc -static`."""
    source = PAUSE_SOURCE.read_bytes()
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, check=True).stdout

    def build() -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            binary = Path(tmp) / "pause"
            cmd = ["gcc", "-static", "-Os", "-s", "-o", str(binary), str(PAUSE_SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise ContainerdError(f"building the pause binary failed: {done.stderr.strip()}")
            layer = layer_tar([LayerFile("pause", binary.read_bytes())])
        return oci_archive(PAUSE_IMAGE, layer, {"Entrypoint": ["/pause"]})

    return _cached("pause", [source, gcc], build)


def busybox_archive() -> Path:
    """The container image: Debian's static busybox as /bin/busybox with a symlink for every applet."""
    binary = Path(shutil.which("busybox") or "busybox").resolve()
    data = binary.read_bytes()

    def build() -> bytes:
        listing = subprocess.run([str(binary), "--list"], capture_output=True, text=True, check=True).stdout
        applets = sorted({a for a in listing.split() if a != "busybox"})
        entries = [LayerFile("bin"), LayerFile("bin/busybox", data)]
        entries += [LayerFile(f"bin/{a}", target="busybox") for a in applets]
        entries += [LayerFile(d) for d in ("dev", "etc", "proc", "sys")]
        entries.append(LayerFile("tmp", mode=0o1777))
        layer = layer_tar(entries)
        return oci_archive(BUSYBOX_IMAGE, layer, {"Env": ["PATH=/bin"], "Cmd": ["sh"]})

    return _cached("busybox", [data], build)


# ---------------------------------------------------------------- the daemon


@dataclass(frozen=True)
class Runtime:
    """One containerd release: where its binaries are and what its config looks like."""

    name: str  # "1.6", "1.7", "2": what tests and `--containerd` call it
    suite: str  # the Debian suite it comes from
    prefix: Path | None  # the extracted package root; None: the machine's own, on PATH

    def binary(self, name: str) -> str:
        """containerd, containerd-shim-runc-v2 or ctr of this release."""
        return name if self.prefix is None else str(self.prefix / "usr" / "bin" / name)

    @property
    def has_cdi(self) -> bool:
        return self.name != "1.6"

    @property
    def has_nri(self) -> bool:
        """1.7 carries NRI 0.6 (off by default), 2.x NRI 0.8 (on by default); 1.6 has none."""
        return self.name != "1.6"

    def unavailable(self) -> str | None:
        """Why this release can not run here (tests/runtimes.sh did not fetch it), or None."""
        if self.prefix is None:
            return missing_requirements()
        if Path(self.binary("containerd")).is_file():
            return missing_requirements()
        note = self.prefix.parent / "unavailable"
        if note.is_file():
            return note.read_text().strip()
        return f"containerd {self.name} (Debian {self.suite}) is not in {self.prefix.parent}: run tests/runtimes.sh"

    def package_version(self) -> str:
        """The Debian package version, as tests/runtimes.sh recorded it (the system's from dpkg)."""
        if self.prefix is not None:
            return (self.prefix.parent / "version").read_text().strip()
        query = ["dpkg-query", "-W", "-f=${Version}", "containerd"]
        return subprocess.run(query, capture_output=True, text=True).stdout.strip() or "unknown"

    def config(self, base: Path, nri: bool = False) -> str:
        """The config for an instance living in `base`; `nri` turns NRI on with private paths."""
        if nri and not self.has_nri:
            raise ContainerdError(f"containerd {self.name} has no NRI")
        return _config_v3(base, self, nri) if self.name == "2" else _config_v2(base, self, nri)


def runtimes_dir() -> Path:
    """Where tests/runtimes.sh extracts the downloaded releases (the same rule as the script)."""
    if "CRIHOOK_RUNTIMES" in os.environ:
        return Path(os.environ["CRIHOOK_RUNTIMES"])
    return cache_dir() / "runtimes"


def runtime(name: str) -> Runtime:
    """The release called `name` ("1.6", "1.7" or "2")."""
    suites = {"1.6": "bookworm", "1.7": "trixie", "2": "sid"}
    if name not in suites:
        raise ValueError(f"unknown containerd release {name!r}; known: {', '.join(suites)}")
    prefix = None if name == "1.6" else runtimes_dir() / suites[name] / "root"
    return Runtime(name, suites[name], prefix)


RUNTIMES = ("1.6", "1.7", "2")
SYSTEM = runtime("1.6")


def _runc() -> str:
    """bookworm's runc, for every release (sid's and trixie's runc need glibc 2.38)."""
    return shutil.which("runc") or "/usr/sbin/runc"


# Disabled in every release: snapshotters that cannot work here, and the opt plugin, which would
# install into the shared /opt/containerd.
_DISABLED = """disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]"""


# NRI's default timeouts in seconds (pkg/api/timeouts.go): a plugin must register within the first
# and answer each call within the second, or the runtime drops it.
NRI_REGISTRATION_TIMEOUT = 5
NRI_REQUEST_TIMEOUT = 2


def _nri_section(base: Path, quote: str, nri: bool) -> str:
    """The NRI plugin's table: off, or on with its socket and plugin dirs inside `base` and the
    default timeouts written out, so that tests can rely on them."""
    head = f"[plugins.{quote}io.containerd.nri.v1.nri{quote}]"  # 1.7 quotes keys with ", 2.x with '"
    if not nri:
        return f"{head}\n  disable = true\n"
    return f"""{head}
  disable = false
  disable_connections = false
  socket_path = "{base}/nri/nri.sock"
  plugin_path = "{base}/nri/plugins"
  plugin_config_path = "{base}/nri/conf.d"
  plugin_registration_timeout = "{NRI_REGISTRATION_TIMEOUT}s"
  plugin_request_timeout = "{NRI_REQUEST_TIMEOUT}s"
"""


def _top(base: Path, version: int, quote: str, nri: bool) -> str:
    """What both config versions start with: the private root, state and sockets, and NRI."""
    # Without CRI the daemon is useless to us: exit at once instead of serving without it. (The
    # legacy io.containerd.runtime.v1.linux must stay enabled: in 1.6 the tasks service, and through
    # it CRI, refuse to load without it.)
    return f"""\
version = {version}
root = "{base}/root"
state = "{base}/state"
oom_score = 0
{_DISABLED}
required_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{base}/containerd.sock"

[ttrpc]
  address = "{base}/containerd.sock.ttrpc"

{_nri_section(base, quote, nri)}"""


def _config_v2(base: Path, rt: Runtime, nri: bool = False) -> str:
    """containerd 1.6/1.7 config (version 2) with every path inside `base`, so it shares nothing with a
    containerd the machine may already run. runc's state root is ours too, which lets cleanup find
    the containers even when containerd is gone."""
    cri = '[plugins."io.containerd.grpc.v1.cri"'
    # 1.6 knows no CDI and no runtime_path (its shim is the one on PATH, also 1.6).
    newer = (
        f"""
  enable_cdi = true
  cdi_spec_dirs = ["{base}/cdi"]
"""
        if rt.has_cdi
        else ""
    )
    shim = f'\n      runtime_path = "{rt.binary("containerd-shim-runc-v2")}"' if rt.prefix is not None else ""
    return f"""{_top(base, 2, '"', nri)}
{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"{newer}
  {cri}.cni]
    bin_dir = "{base}/cni/bin"
    conf_dir = "{base}/cni/net.d"

  {cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    {cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"{shim}

      {cri}.containerd.runtimes.runc.options]
        BinaryName = "{_runc()}"
        Root = "{base}/runc"
        SystemdCgroup = false
"""


def _config_v3(base: Path, rt: Runtime, nri: bool = False) -> str:
    """containerd 2.x config (version 3): CRI is split into an images and a runtime plugin, and the
    sandbox image is a pinned image."""
    run = "[plugins.'io.containerd.cri.v1.runtime'"
    return f"""{_top(base, 3, "'", nri)}
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

{run}]
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["{base}/cdi"]

  {run}.cni]
    bin_dirs = ["{base}/cni/bin"]
    conf_dir = "{base}/cni/net.d"

  {run}.containerd]
    default_runtime_name = "runc"

    {run}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{rt.binary("containerd-shim-runc-v2")}"

      {run}.containerd.runtimes.runc.options]
        BinaryName = "{_runc()}"
        Root = "{base}/runc"
        SystemdCgroup = false
"""


@dataclass
class Containerd:
    """A private containerd: `start()`, `stop()`, `restart()`, `close()`; `address` is what a CRI client dials.

    Containers outlive a `restart()` the way they outlive a containerd upgrade on a node: their shims
    keep running and containerd reconnects to them. `close()` removes everything, containers included.
    """

    base: Path
    cgroup_root: str = CGROUP_ROOT
    runtime: Runtime = SYSTEM
    nri: bool = False  # NRI on, with the private paths below
    pause_image: str = PAUSE_IMAGE
    busybox_image: str = BUSYBOX_IMAGE
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def create(cls, cgroup_root: str = CGROUP_ROOT, runtime: Runtime = SYSTEM, nri: bool | None = None) -> Containerd:
        """A stopped instance with its directory and config written. `cgroup_root` is the parent of
        the pod cgroups of the pods it will run (`cri.pod_config(cgroup_root=...)`); close removes it.
        `nri`: NRI on or off; by default on where the release has it."""
        nri = runtime.has_nri if nri is None else nri
        base = Path(tempfile.mkdtemp(prefix="crihook-containerd-"))
        (base / "config.toml").write_text(runtime.config(base, nri))
        if runtime.has_cdi:
            (base / "cdi").mkdir()
        if nri:
            for sub in ("plugins", "conf.d"):
                (base / "nri" / sub).mkdir(parents=True)
        return cls(base, cgroup_root, runtime, nri)

    @property
    def config_path(self) -> Path:
        return self.base / "config.toml"

    @property
    def cdi_spec_dir(self) -> Path:
        """The only CDI spec dir this instance searches (1.7 and 2.x; 1.6 has no CDI)."""
        if not self.runtime.has_cdi:
            raise ContainerdError(f"containerd {self.runtime.name} has no CDI")
        return self.base / "cdi"

    def _nri_path(self, name: str) -> Path:
        if not self.nri:
            raise ContainerdError(f"this containerd {self.runtime.name} runs without NRI")
        return self.base / "nri" / name

    @property
    def nri_socket(self) -> Path:
        """Where external NRI plugins dial this instance (it creates the socket at start)."""
        return self._nri_path("nri.sock")

    @property
    def nri_plugin_dir(self) -> Path:
        """Pre-registered plugins (`NN-name` executables), started by containerd at its start."""
        return self._nri_path("plugins")

    @property
    def nri_plugin_config_dir(self) -> Path:
        """Configs of pre-registered plugins (`NN-name.conf` or `name.conf`)."""
        return self._nri_path("conf.d")

    @property
    def socket(self) -> Path:
        return self.base / "containerd.sock"

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.base / "containerd.log"

    @property
    def runc_root(self) -> Path:
        """Where runc keeps the state of CRI's containers (runc's --root)."""
        return self.base / "runc" / NAMESPACE

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def start(self, timeout: float = 30.0) -> None:
        """Start the daemon and return once its CRI service answers."""
        if self.pid is not None:
            raise ContainerdError(f"containerd already runs as pid {self.pid}")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [self.runtime.binary("containerd"), "--config", str(self.config_path), "--log-level", "info"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal must not kill it mid-teardown
            )
        self._wait_cri(timeout)

    def _wait_cri(self, timeout: float) -> None:
        """CRI answers "server is not initialized yet" until it has recovered its state and subscribed
        to image events; an image imported before that would stay invisible to CRI. With NRI on, its
        socket must be there too, so a plugin can dial as soon as `start()` returns."""
        deadline = time.monotonic() + timeout
        last = "socket not there yet"
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise ContainerdError(f"containerd exited during start:\n{self.log_tail()}")
            if self.socket.exists() and (not self.nri or self.nri_socket.exists()):
                try:
                    self._cri_call("RuntimeService/Version", b"")  # an empty VersionRequest is zero bytes
                    return
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                        raise ContainerdError(f"containerd serves no CRI:\n{self.log_tail()}") from e
                    last = f"{e.code().name}: {e.details()}"
            time.sleep(0.05)
        raise ContainerdError(f"containerd CRI not ready after {timeout}s ({last}):\n{self.log_tail()}")

    def _cri_call(self, method: str, request: bytes) -> bytes:
        """One unary CRI call with hand-encoded bytes: start-up checks must not depend on the
        generated stubs, which the tests run through this daemon exercise."""
        with grpc.insecure_channel(self.address) as channel:
            call = channel.unary_unary(f"/runtime.v1.{method}", request_serializer=None, response_deserializer=None)
            reply: bytes = call(request, timeout=5)
            return reply

    def cri_sees_image(self, ref: str) -> bool:
        # ImageStatusRequest{image: ImageSpec{image: ref}}; the reply is empty when the image is unknown
        request = length_delimited(1, length_delimited(1, ref.encode()))
        return self._cri_call("ImageService/ImageStatus", request) != b""

    def stop(self, kill: bool = False, timeout: float = 30.0) -> None:
        """Stop the daemon by its pid: SIGTERM, or SIGKILL to play a crash. Containers keep running."""
        if self.process is not None:
            end_process(self.process, kill, timeout)
        self.process = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def ctr(self, *args: str, timeout: float = 60.0) -> str:
        """Run `ctr` against this daemon in CRI's namespace; its stdout, or ContainerdError."""
        cmd = [self.runtime.binary("ctr"), "--address", str(self.socket), "--namespace", NAMESPACE, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise ContainerdError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def delete_task(self, container_id: str) -> None:
        """Kill and delete a container's task through containerd's own API. containerd 1.6 can leave
        a task that CRI does not own (a StartContainer cancelled while the task was being created):
        StopContainer skips it, as CRI believes the container is not running, and every
        RemoveContainer fails with "cannot delete running task" until the task is gone."""
        with contextlib.suppress(ContainerdError):  # no task: nothing to delete
            self.ctr("tasks", "delete", "--force", container_id)

    def import_image(self, archive: Path) -> None:
        """Import and unpack an OCI archive into the overlayfs snapshotter CRI uses."""
        self.ctr("images", "import", "--snapshotter", "overlayfs", str(archive))

    def import_images(self, timeout: float = 10.0) -> None:
        """Import both images and wait until CRI lists them: an import reaches CRI's image
        store through an event, and a RunPodSandbox that came first would try to pull the pause image."""
        self.import_image(pause_archive())
        self.import_image(busybox_archive())
        deadline = time.monotonic() + timeout
        while not all(self.cri_sees_image(ref) for ref in (self.pause_image, self.busybox_image)):
            if time.monotonic() > deadline:
                raise ContainerdError(f"CRI does not list the pause and busybox images {timeout}s after import")
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def close(self) -> None:
        """Stop containerd and leave nothing behind: containers, shims, mounts, cgroups, files."""
        self.stop()
        self._delete_containers()
        self._kill_shims()
        unmount_below(self.base)
        shutil.rmtree(self.base, ignore_errors=True)
        remove_cgroup_tree(self.cgroup_root)

    def _delete_containers(self) -> None:
        """`runc delete --force` kills what is still running and removes its cgroups."""
        if not self.runc_root.is_dir():
            return
        for entry in self.runc_root.iterdir():
            subprocess.run(
                ["runc", "--root", str(self.runc_root), "delete", "--force", entry.name],
                capture_output=True,
                stdin=subprocess.DEVNULL,
                timeout=30,
            )

    def _kill_shims(self) -> None:
        """A shim exits when containerd tells it to; with containerd gone, end ours by pid. Ours are
        the ones started with `-address <our socket>`."""
        for pid in shim_pids(str(self.socket)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def end_process(process: subprocess.Popen[bytes], kill: bool, timeout: float) -> None:
    """A process this module started, ended by its pid: SIGTERM (SIGKILL to play a crash), then
    SIGKILL if it is still there after `timeout` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def shim_pids(containerd_socket: str) -> list[int]:
    """Pids of the runc shims serving the containerd at this socket."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if args and args[0].endswith("containerd-shim-runc-v2") and _flag(args, "-address") == containerd_socket:
            found.append(int(proc.name))
    return found


def _flag(args: list[str], name: str) -> str | None:
    with contextlib.suppress(ValueError, IndexError):
        return args[args.index(name) + 1]
    return None


def mount_table() -> list[tuple[Path, str]]:
    """(mount point, filesystem type) of every mount this process sees."""
    table = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        # the mount point is field 5, with space, tab, newline and backslash as octal escapes
        point = before.split()[4].encode().decode("unicode_escape")
        table.append((Path(point), after.split()[0]))
    return table


def mounts_below(base: Path) -> list[Path]:
    """Mount points at or under `base`, deepest first (the order to unmount them in)."""
    found = [point for point, _ in mount_table() if point == base or base in point.parents]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def unmount_below(base: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    mnt_detach = 2
    for point in mounts_below(base):
        if libc.umount2(os.fsencode(point), mnt_detach) != 0:
            err = ctypes.get_errno()
            raise ContainerdError(f"umount {point}: {os.strerror(err)}")


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup v1 controller and of the v2 tree (cgroup v1, v2 and hybrid hosts)."""
    return [point for point, fstype in mount_table() if fstype in ("cgroup", "cgroup2")]


def remove_cgroup_tree(path: str) -> None:
    """rmdir `path` and everything below it in every hierarchy. runc removes a container's own cgroup
    but not the pod's parent, which kubelet would; a cgroup still holding a process is an error."""
    busy = []
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / path.lstrip("/")
        if not top.is_dir():
            continue
        for current, _, _ in sorted(os.walk(top), key=lambda walked: len(walked[0]), reverse=True):
            try:
                os.rmdir(current)
            except OSError as e:
                busy.append(f"{current}: {e.strerror}")
    if busy:
        raise ContainerdError("cgroups left behind: " + "; ".join(busy))


@contextlib.contextmanager
def running_containerd(
    cgroup_root: str = CGROUP_ROOT, runtime: Runtime = SYSTEM, nri: bool | None = None
) -> Iterator[Containerd]:
    """A started containerd with both images imported, closed on exit whatever happens; `nri`
    as in `Containerd.create`."""
    daemon = Containerd.create(cgroup_root, runtime, nri)
    try:
        daemon.start()
        daemon.import_images()
        yield daemon
    finally:
        daemon.close()
