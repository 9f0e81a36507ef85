"""The package's CRI client (crihook.simnode.cri) with the test containerd's defaults: its busybox
image, and cgroup parents below this test process's cgroup root, which the session removes."""

from __future__ import annotations

from functools import partial

from crihook.simnode import cri as _cri
from crihook.simnode.cri import (  # noqa: F401  (what tests import from here)
    CONTAINER_NAME,
    POD_NAME,
    POD_NAMESPACE,
    POD_UID,
    SLEEP_FOREVER,
    Cri,
    CriError,
    DeviceSpec,
)
from tests.support.containerd import BUSYBOX_IMAGE, CGROUP_ROOT

pod_config = partial(_cri.pod_config, cgroup_root=CGROUP_ROOT)
container_config = partial(_cri.container_config, image=BUSYBOX_IMAGE)
