"""install.sh into staging roots that look like fresh kubeadm GPU nodes: the files it writes, the
kubelet drop-in, `systemd-analyze verify` on the result, idempotence, and an uninstall that gives
the tree back byte for byte. Also the unit file and the config template on their own."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tomllib
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from crihook.base import config as cfg

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "install.sh"
UNIT = REPO / "systemd" / "crihook.service"
NRI_UNIT = REPO / "systemd" / "crihook-nri.service"
DRA_UNIT = REPO / "systemd" / "crihook-dra.service"
TEMPLATE = REPO / "systemd" / "config.toml"
# the folders pyproject.toml's package-dir installs, read from it so a new package is never left out
PACKAGE_DIRS = tuple(
    sorted(
        {
            d.split("/")[0]
            for d in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
        }
    )
)
HOST_UNITS = Path("/usr/lib/systemd/system")

KUBELET_UNIT = """\
[Unit]
Description=kubelet: The Kubernetes Node Agent
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always

[Install]
WantedBy=multi-user.target
"""
KUBEADM_DROPIN = """\
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
"""
KUBEADM_EXEC = KUBEADM_DROPIN.splitlines()[-1].removeprefix("ExecStart=")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """crihook as a wheel, built from a copy of the sources so the checkout gets no build output."""
    src = tmp_path_factory.mktemp("src")
    for name in PACKAGE_DIRS:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, src],
        check=True,
        timeout=120,
    )
    return next(out.glob("crihook-*.whl"))


def listen_at(sock: Path) -> None:
    sock.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))


def make_node(root: Path, *, kubeadm: bool = True, nri: bool = False) -> Path:
    """A fresh node's tree: containerd listening (and its NRI socket with `nri`), kubelet installed
    from the Kubernetes packages, and systemd's own units (so `systemd-analyze verify --root` can
    resolve targets)."""
    listen_at(root / "run/containerd/containerd.sock")
    if nri:
        listen_at(root / "var/run/nri/nri.sock")
    units = root / "usr/lib/systemd/system"
    if HOST_UNITS.is_dir():
        shutil.copytree(HOST_UNITS, units, symlinks=True)
    units.mkdir(parents=True, exist_ok=True)
    (units / "kubelet.service").write_text(KUBELET_UNIT)
    if kubeadm:
        (units / "kubelet.service.d").mkdir()
        (units / "kubelet.service.d/10-kubeadm.conf").write_text(KUBEADM_DROPIN)
    (root / "usr/bin").mkdir(parents=True)
    for tool in ("kubelet", "kill", "mkdir"):
        (root / "usr/bin" / tool).write_text("#!/bin/sh\n")
        (root / "usr/bin" / tool).chmod(0o755)
    (root / "bin").symlink_to("usr/bin")
    (root / "etc/default").mkdir(parents=True)
    (root / "etc/default/kubelet").write_text("KUBELET_EXTRA_ARGS=--node-labels=gpu=true\n")
    return root


def install(root: Path, wheel: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["bash", str(INSTALL), "--root", str(root), "--source", str(wheel), "--pip-args", "--no-deps --no-index"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=180)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Every path below root: type, mode and content (or link target)."""
    tree: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel.startswith(skip):
                continue
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                tree[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                tree[rel] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes())
            else:
                tree[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
    return tree


def dropin_exec_start(root: Path) -> tuple[str, str]:
    text = (root / "etc/systemd/system/kubelet.service.d/99-crihook.conf").read_text()
    env = re.search(r'^Environment="CRIHOOK_KUBELET_ARGS=(.*)"$', text, re.M)
    starts = re.findall(r"^ExecStart=(.*)$", text, re.M)
    assert env and starts[0] == "" and len(starts) == 2, text
    return env.group(1), starts[1]


def verify_units(root: Path, unit: str = "crihook.service") -> None:
    if shutil.which("systemd-analyze") is None or not (HOST_UNITS / "sysinit.target").exists():
        pytest.skip("systemd-analyze and systemd's units are needed (Debian package systemd)")
    done = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", unit, "kubelet.service"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


# -- install, verify, uninstall --------------------------------------------------------------------


def test_install_on_a_fresh_node_and_uninstall_byte_for_byte(tmp_path: Path, wheel: Path) -> None:
    root = make_node(tmp_path / "root")
    before = snapshot(root)
    install(root, wheel)

    etc = root / "etc"
    assert (etc / "systemd/system/crihook.service").read_bytes() == UNIT.read_bytes()
    assert (etc / "crihook/config.toml").read_bytes() == TEMPLATE.read_bytes()
    args, exec_start = dropin_exec_start(root)
    assert args == (
        "--container-runtime-endpoint=unix:///var/run/crihook/crihook.sock "
        "--image-service-endpoint=unix:///run/containerd/containerd.sock"
    )
    assert exec_start == KUBEADM_EXEC + " $CRIHOOK_KUBELET_ARGS"
    wants = etc / "systemd/system/multi-user.target.wants/crihook.service"
    assert os.readlink(wants) == "/etc/systemd/system/crihook.service"
    assert stat.S_IMODE((root / "var/lib/crihook").stat().st_mode) == 0o700
    version = subprocess.run(
        [root / "opt/crihook/venv/bin/crihook", "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.stdout.startswith("crihook ")
    verify_units(root)

    done = install(root, wheel, "--uninstall")
    assert "crihook removed" in done.stdout
    assert snapshot(root) == before


def test_second_install_changes_nothing(tmp_path: Path, wheel: Path) -> None:
    root = make_node(tmp_path / "root")
    install(root, wheel)
    first = snapshot(root, skip=("opt/crihook/venv",))
    record = (root / "opt/crihook/install.record").read_text()
    done = install(root, wheel)
    assert "keeping the existing /etc/crihook/config.toml" in done.stdout
    assert snapshot(root, skip=("opt/crihook/venv",)) == first
    assert (root / "opt/crihook/install.record").read_text() == record


def test_existing_files_are_kept_or_backed_up_and_restored(tmp_path: Path, wheel: Path) -> None:
    """An operator's config stays and decides the drop-in; a unit someone else left is replaced and
    comes back on uninstall; kubelet set up by hand (unit in /etc, continued lines, a drop-in that
    masks the packaged one of the same name) is extended as systemd would read it."""
    root = make_node(tmp_path / "root")
    (root / "etc/crihook").mkdir(parents=True)
    (root / "etc/crihook/config.toml").write_text(
        '[proxy]\nlisten = "unix:///run/gpu/cri.sock"\nimage_endpoint = "unix:///run/images.sock"\n'
    )
    (root / "etc/systemd/system/kubelet.service.d").mkdir(parents=True)
    (root / "etc/systemd/system/crihook.service").write_text("[Service]\nExecStart=/usr/local/bin/old-crihook\n")
    (root / "etc/systemd/system/kubelet.service").write_text(
        "[Service]\nExecStart=/usr/bin/kubelet \\\n    --v=2 \\\n    --config=/etc/k.yaml\n"
    )
    (root / "etc/systemd/system/kubelet.service.d/10-kubeadm.conf").write_text("[Service]\nEnvironment=A=1\n")
    (root / "etc/systemd/system/kubelet.service.d/20-flags.conf").write_text(
        "[Service]\nExecStart=\nExecStart=/usr/bin/kubelet --config=/etc/k.yaml --max-pods=50\n"
    )
    before = snapshot(root)
    install(root, wheel)

    assert (root / "etc/crihook/config.toml").read_text().startswith('[proxy]\nlisten = "unix:///run/gpu/cri.sock"')
    args, exec_start = dropin_exec_start(root)
    assert (
        args == "--container-runtime-endpoint=unix:///run/gpu/cri.sock --image-service-endpoint=unix:///run/images.sock"
    )
    # /etc's 10-kubeadm.conf (no ExecStart) masks the packaged one, so 20-flags.conf decides.
    assert exec_start == "/usr/bin/kubelet --config=/etc/k.yaml --max-pods=50 $CRIHOOK_KUBELET_ARGS"
    assert (root / "etc/systemd/system/crihook.service").read_bytes() == UNIT.read_bytes()

    install(root, wheel, "--uninstall")
    assert snapshot(root) == before


def test_continued_exec_start_lines_are_joined(tmp_path: Path, wheel: Path) -> None:
    root = make_node(tmp_path / "root", kubeadm=False)
    (root / "usr/lib/systemd/system/kubelet.service").write_text(
        "[Service]\nExecStart=/usr/bin/kubelet \\\n    --v=2 \\\n    --config=/etc/k.yaml\n"
    )
    install(root, wheel, "--prefix", "/srv/crihook")
    assert dropin_exec_start(root)[1] == "/usr/bin/kubelet      --v=2      --config=/etc/k.yaml $CRIHOOK_KUBELET_ARGS"
    unit = (root / "etc/systemd/system/crihook.service").read_text()
    assert "ExecStart=/srv/crihook/venv/bin/crihook serve --config /etc/crihook/config.toml" in unit
    assert "/opt/crihook" not in unit
    assert (root / "srv/crihook/venv/bin/crihook").exists()
    verify_units(root)


# -- NRI mode --------------------------------------------------------------------------------------


def test_nri_mode_leaves_kubelet_alone_and_uninstalls_byte_for_byte(tmp_path: Path, wheel: Path) -> None:
    root = make_node(tmp_path / "root", nri=True)
    before = snapshot(root)
    done = install(root, wheel, "--mode", "nri")
    assert "kubelet is left as it is" in done.stdout

    etc = root / "etc/systemd/system"
    assert (etc / "crihook-nri.service").read_bytes() == NRI_UNIT.read_bytes()
    assert not (etc / "crihook.service").exists()
    assert not (etc / "kubelet.service.d").exists()
    assert os.readlink(etc / "multi-user.target.wants/crihook-nri.service") == "/etc/systemd/system/crihook-nri.service"
    assert (root / "etc/crihook/config.toml").read_bytes() == TEMPLATE.read_bytes()
    verify_units(root, "crihook-nri.service")
    second = install(root, wheel, "--mode", "nri")
    assert "keeping the existing /etc/crihook/config.toml" in second.stdout

    install(root, wheel, "--uninstall")
    assert snapshot(root) == before


def test_nri_mode_prefix_and_socket_are_written_into_the_unit(tmp_path: Path, wheel: Path) -> None:
    root = make_node(tmp_path / "root", kubeadm=False)
    listen_at(root / "run/containerd/nri/nri.sock")
    install(root, wheel, "--mode", "nri", "--prefix", "/srv/crihook", "--nri-socket", "/run/containerd/nri/nri.sock")
    unit = (root / "etc/systemd/system/crihook-nri.service").read_text()
    assert (
        "ExecStart=/srv/crihook/venv/bin/crihook nri --config /etc/crihook/config.toml"
        " --nri-socket /run/containerd/nri/nri.sock" in unit
    )
    assert "/opt/crihook" not in unit and "/var/run/nri" not in unit


@pytest.mark.parametrize("mode", ["proxy", "nri"])
def test_a_containerd_socket_elsewhere_is_given_to_crihook(tmp_path: Path, wheel: Path, mode: str) -> None:
    """Both modes dial containerd's CRI socket ([node] runtime_endpoint): the one install.sh checked."""
    root = make_node(tmp_path / "root", nri=mode == "nri")
    listen_at(root / "run/k3s/containerd/containerd.sock")
    install(root, wheel, "--mode", mode, "--containerd-socket", "/run/k3s/containerd/containerd.sock")
    name = "crihook-nri.service" if mode == "nri" else "crihook.service"
    unit = (root / "etc/systemd/system" / name).read_text()
    (start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert start.endswith(" --runtime-endpoint unix:///run/k3s/containerd/containerd.sock"), start
    verify_units(root, name)


# -- the DRA driver --------------------------------------------------------------------------------

KUBECONFIG_SET = '[reporter]\nkubeconfig = "/etc/crihook/kubeconfig"\n'


@pytest.mark.parametrize("mode", ["proxy", "nri"])
def test_the_dra_driver_beside_either_mode_kept_on_upgrade_and_uninstalled(
    tmp_path: Path, wheel: Path, mode: str
) -> None:
    root = make_node(tmp_path / "root", nri=mode == "nri")
    (root / "etc/crihook").mkdir(parents=True)
    (root / "etc/crihook/config.toml").write_text(KUBECONFIG_SET)
    before = snapshot(root)
    prefix = ["--prefix", "/srv/crihook"] if mode == "nri" else []
    install(root, wheel, "--mode", mode, "--dra", *prefix)

    etc = root / "etc/systemd/system"
    unit = (etc / "crihook-dra.service").read_text()
    if prefix:
        assert unit == DRA_UNIT.read_text().replace("/opt/crihook/", "/srv/crihook/")
        assert "ExecStart=/srv/crihook/venv/bin/crihook dra --config /etc/crihook/config.toml" in unit
    else:
        assert unit == DRA_UNIT.read_text()
    assert os.readlink(etc / "multi-user.target.wants/crihook-dra.service") == "/etc/systemd/system/crihook-dra.service"
    verify_units(root, "crihook-dra.service")
    installed = snapshot(root, skip=("opt/crihook/venv", "srv/crihook/venv"))
    install(root, wheel, "--mode", mode, *prefix)  # an upgrade without --dra keeps the driver
    assert snapshot(root, skip=("opt/crihook/venv", "srv/crihook/venv")) == installed

    install(root, wheel, "--uninstall", *prefix)
    assert snapshot(root) == before


def test_the_dra_driver_is_refused_without_a_kubeconfig(tmp_path: Path) -> None:
    """The driver would only exit and be restarted: the installer says what to set, before changing anything."""
    root = make_node(tmp_path / "root")
    err = refuse("--root", str(root), "--dra")
    assert "[reporter] kubeconfig, which /etc/crihook/config.toml does not set" in err
    assert not (root / "opt").exists() and not (root / "etc/crihook").exists()


def test_nri_mode_refuses_without_the_nri_socket_and_says_how_to_turn_it_on(tmp_path: Path) -> None:
    root = make_node(tmp_path / "root")
    err = refuse("--root", str(root), "--mode", "nri")
    assert "no NRI socket at /var/run/nri/nri.sock" in err
    assert '[plugins."io.containerd.nri.v1.nri"]\n      disable = false' in err
    assert "containerd 1.6 has no NRI: use --mode proxy" in err
    assert not (root / "opt").exists()


def test_one_mode_at_a_time(tmp_path: Path, wheel: Path) -> None:
    """Switching modes goes through --uninstall, which also takes kubelet's drop-in away."""
    root = make_node(tmp_path / "root", nri=True)
    install(root, wheel)
    err = install(root, wheel, "--mode", "nri", check=False)
    assert err.returncode == 1 and "installed here in proxy mode" in err.stderr
    install(root, wheel, "--uninstall")
    install(root, wheel, "--mode", "nri")
    err = install(root, wheel, check=False)
    assert err.returncode == 1 and "installed here in NRI mode" in err.stderr


# -- clear refusals --------------------------------------------------------------------------------


def refuse(*args: str, env: dict[str, str] | None = None, user: bool = False) -> str:
    cmd = ["bash", str(INSTALL), *args]
    if user:
        if shutil.which("setpriv") is None or os.geteuid() != 0:
            pytest.skip("needs root and setpriv to run the installer as another user")
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == "" or "error" not in done.stdout
    return done.stderr


def test_refuses_without_containerd(tmp_path: Path) -> None:
    root = make_node(tmp_path / "root")
    (root / "run/containerd/containerd.sock").unlink()
    err = refuse("--root", str(root))
    assert "no containerd socket at /run/containerd/containerd.sock" in err
    assert "systemctl status containerd" in err
    assert not (root / "opt").exists()


def test_refuses_without_kubelet(tmp_path: Path) -> None:
    root = make_node(tmp_path / "root")
    (root / "usr/lib/systemd/system/kubelet.service").unlink()
    err = refuse("--root", str(root))
    assert "no kubelet.service" in err and "--skip-kubelet" in err


def test_refuses_old_python(tmp_path: Path) -> None:
    root = make_node(tmp_path / "root")
    old = tmp_path / "python3.9"
    old.write_text('#!/bin/sh\ncase "$2" in *platform*) echo 3.9.2 ;; *) exit 1 ;; esac\n')
    old.chmod(0o755)
    err = refuse("--root", str(root), "--python", str(old))
    assert "is Python 3.9.2; crihook needs 3.11 or newer" in err


def test_refuses_non_root(tmp_path: Path) -> None:
    err = refuse(user=True)
    assert "must run as root" in err and "--root DIR" in err


@pytest.mark.skipif(Path("/run/systemd/system").exists(), reason="this machine runs systemd: it would install")
def test_refuses_without_systemd() -> None:
    assert "systemd is not running on this machine" in refuse()


def test_refuses_bad_arguments(tmp_path: Path) -> None:
    assert "--prefix must be an absolute path" in refuse("--root", str(tmp_path), "--prefix", "opt/x")
    assert "--prefix must be an absolute path" in refuse("--root", str(tmp_path), "--prefix", "/opt/a b")
    assert "unknown argument --frobnicate" in refuse("--frobnicate")
    assert "--mode must be proxy or nri, not 'cri'" in refuse("--mode", "cri")
    assert "--root needs a value" in refuse("--root")
    assert "nothing to undo" in refuse("--root", str(tmp_path), "--uninstall")


# -- the unit and the config template --------------------------------------------------------------


def unit_sections(path: Path = UNIT) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def test_unit_shape() -> None:
    unit = unit_sections()
    service = unit["Service"]
    assert service["Type"] == "notify" and service["Restart"] == "always"
    assert service["WatchdogSec"].endswith("s") and int(service["WatchdogSec"][:-1]) > 0
    assert "containerd.service" in unit["Unit"]["After"].split()
    assert "kubelet.service" in unit["Unit"]["Before"].split()
    assert service["ExecStart"] == "/opt/crihook/venv/bin/crihook serve --config " + str(cfg.DEFAULT_CONFIG)
    # State and socket directories match the config defaults.
    assert f"/var/lib/{service['StateDirectory']}" == cfg.ProxyConfig().state_dir
    assert cfg.DEFAULT_LISTEN.startswith(f"unix:///var/run/{service['RuntimeDirectory']}/")


def test_nri_unit_shape() -> None:
    unit = unit_sections(NRI_UNIT)
    service = unit["Service"]
    assert service["Type"] == "notify" and service["Restart"] == "always"
    assert "containerd.service" in unit["Unit"]["After"].split()
    assert "kubelet.service" in unit["Unit"]["Before"].split()
    assert service["ExecStart"] == (
        f"/opt/crihook/venv/bin/crihook nri --config {cfg.DEFAULT_CONFIG} --nri-socket /var/run/nri/nri.sock"
    )
    assert f"/var/lib/{service['StateDirectory']}" == cfg.ProxyConfig().state_dir
    assert "RuntimeDirectory" not in service  # no socket of its own


@pytest.mark.parametrize("path", [UNIT, NRI_UNIT, DRA_UNIT], ids=["proxy", "nri", "dra"])
def test_unit_leaves_devices_reachable(path: Path) -> None:
    """NVML opens /dev/nvidia*: anything that installs a device allow-list would break it."""
    service = unit_sections(path)["Service"]
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock"):
        assert key not in service, key
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"


def test_config_template_documents_every_key_with_its_default() -> None:
    """Uncommenting every `# key = value` line must give exactly the built-in defaults."""
    lines = []
    section = ""
    documented: set[tuple[str, str]] = set()
    for line in TEMPLATE.read_text().splitlines():
        if re.match(r"^\[(\w+)\]$", line):
            section = line.strip("[]")
        m = re.match(r"^# (\w+) = (.*)$", line)
        if m and section in {"proxy", "node", "hooks", "reporter", "usage", "nri"}:
            documented.add((section, m.group(1)))
            line = f"{m.group(1)} = {m.group(2)}"
        lines.append(line)
    parsed = cfg.parse(tomllib.loads("\n".join(lines)))
    assert parsed == cfg.Config()
    defaults = cfg.Config()
    expected = {
        (s.name, f.name)
        for s in fields(defaults)
        if is_dataclass(getattr(defaults, s.name))
        for f in fields(getattr(defaults, s.name))
        if f.metadata.get("key", True)
    }
    assert documented == expected


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("clear_orphan_tasks = 1", "expected bool, got int 1"),
        ("drain_seconds = true", "expected float, got bool True"),
        ("max_message_bytes = true", "expected int, got bool True"),
        ("listen = 3", "expected str, got int 3"),
    ],
)
def test_config_values_of_the_wrong_type_are_refused(line: str, error: str) -> None:
    with pytest.raises(cfg.ConfigError, match=re.escape(f"config [proxy].{line.split()[0]}: {error}")):
        cfg.parse(tomllib.loads(f"[proxy]\n{line}\n"))


def test_config_flags_and_whole_floats_are_accepted() -> None:
    parsed = cfg.parse(tomllib.loads("[proxy]\nclear_orphan_tasks = false\ndrain_seconds = 3\n"))
    assert parsed.proxy.clear_orphan_tasks is False
    assert parsed.proxy.drain_seconds == 3.0 and isinstance(parsed.proxy.drain_seconds, float)
