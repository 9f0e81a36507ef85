"""The checks of crihook's own files: its config, its state dir and store, and the hook-server
files the remote hook reads."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from crihook.base.config import Config, ConfigError, ProxyConfig, load
from crihook.cli.doctor.finding import Finding, Level


def check_config(path: str | None) -> tuple[Config, Finding]:
    try:
        config = load(path)
    except ConfigError as e:
        finding = Finding(
            "config",
            Level.FAIL,
            str(e),
            "correct the file (README.md, Configuration, lists every key); crihook serve refuses to start "
            "with it. The checks below use the built-in defaults.",
        )
        return Config(), finding
    if path and Path(path).exists():
        return config, Finding("config", Level.OK, f"{path} is valid")
    return config, Finding("config", Level.OK, f"no {path or 'config file'}: built-in defaults apply")


def check_state_dir(proxy: ProxyConfig) -> Finding:
    from crihook.node.storefile import StoreFileError, read_file

    name = "state dir"
    state = Path(proxy.state_dir)
    if not state.exists():
        return Finding(
            name,
            Level.WARN,
            f"{state} does not exist yet",
            "crihook creates it when it starts; if crihook is running, it uses another proxy.state_dir",
        )
    mode = state.stat().st_mode
    if not stat.S_ISDIR(mode):
        return Finding(name, Level.FAIL, f"{state} is not a directory", f"move {state} away; crihook recreates it")
    if not os.access(state, os.W_OK | os.X_OK):
        return Finding(name, Level.FAIL, f"{state} is not writable here", "crihook runs as root: run doctor as root")
    store = state / "store.json"
    try:
        body = read_file(store)
    except FileNotFoundError:
        found = f"{state} is usable; no store.json yet (written after the first pod)"
    except StoreFileError as e:
        return Finding(
            name,
            Level.FAIL,
            str(e),
            "crihook sets a damaged store aside at start and rebuilds it from containerd; if it recurs, check "
            "free space (df) and journalctl -u crihook",
        )
    except OSError as e:
        return Finding(name, Level.FAIL, f"{store} can not be read: {e}", "check the file's owner and mode")
    else:
        found = f"{store}: {len(body.get('pods', []))} pod(s), {len(body.get('containers', []))} container(s)"
    if stat.S_IMODE(mode) & 0o022:
        return Finding(
            name,
            Level.WARN,
            f"{found}, but {state} is writable by others (mode {stat.S_IMODE(mode):04o})",
            f"chmod 0700 {state}",
        )
    return Finding(name, Level.OK, found)


def check_hook_servers(config: Config) -> Finding:
    """The Koordinator hook-server files the remote hook reads: a file crihook skips (an unknown
    failure-policy, bad JSON) means a server that is silently not called, which only the log said."""
    from crihook.hooks.remote_config import DEFAULT_DIR, is_server_file, read_server_file

    name = "hook servers"
    if "remote" in config.hooks.disabled:
        return Finding(name, Level.OK, "the remote hook is disabled: no hook servers are called")
    directory = str(config.hooks.options.get("remote", {}).get("config_dir", DEFAULT_DIR))
    try:
        names = sorted(n for n in os.listdir(directory) if is_server_file(n))
    except FileNotFoundError:
        return Finding(name, Level.OK, f"no {directory}: no hook servers configured")
    except OSError as e:
        return Finding(name, Level.FAIL, f"{directory} can not be listed: {e.strerror}", "check its owner and mode")
    servers, skipped, down = [], [], []
    for file in names:
        if not os.path.isfile(os.path.join(directory, file)):
            continue
        try:
            server = read_server_file(directory, file)
        except ConfigError as e:
            skipped.append(str(e))
            continue
        servers.append(f"{file} ({server.policy.value})")
        if not os.path.exists(server.endpoint):
            down.append(f"{file}: {server.endpoint} does not exist")
    if skipped:
        return Finding(
            name,
            Level.FAIL,
            f"{len(skipped)} file(s) in {directory} skipped, their servers are never called: " + "; ".join(skipped),
            "fix the field named; crihook reads the file again within reload_interval_ms (no restart)",
        )
    if down:
        return Finding(
            name,
            Level.WARN,
            "hook server not listening: " + "; ".join(down),
            "start the server (koordlet) or remove its file: while it is down a Fail server refuses every call "
            "it is configured for",
        )
    found = f"{len(servers)} server(s) in {directory}" + (": " + ", ".join(servers) if servers else "")
    return Finding(name, Level.OK, found)
