"""Unix socket endpoints, as crihook's configuration, hook-server files and kubelet's flags name them."""

from __future__ import annotations


def unix_socket_path(endpoint: str, short_form: bool = False) -> str | None:
    """The socket file a unix endpoint names: 'unix:///run/x.sock' or '/run/x.sock' -> '/run/x.sock';
    None for another scheme or a relative path. `short_form` also takes 'unix:/run/x.sock', which
    gRPC and kubelet's flags accept and crihook's own configuration never has."""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
    elif short_form and endpoint.startswith("unix:"):
        path = endpoint[len("unix:") :]
    else:
        path = endpoint
    return path if path.startswith("/") else None
