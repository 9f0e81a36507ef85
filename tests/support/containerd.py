"""The private containerd of crihook.simnode.containerd, as the tests use it.

Using it from a test (fixtures in conftest.py): a test that uses `containerd` (or `containerd_cri`,
`proxy_cri`, `crihook_proxy`) runs once per release in `DEFAULT_RUNTIMES`; `@pytest.mark.runtimes("1.7", "2")`
chooses others. `containerd.runtime` says which one this run has. For CDI:

    @pytest.mark.runtimes("2")                       # 2.x, CDI enabled
    def test_x(containerd, cdi_spec_dir, containerd_cri):
        (cdi_spec_dir / "gpus.json").write_text(json.dumps(spec))   # removed after the test
        ...  # CDI_devices / cdi.k8s.io/* annotations now really inject what the spec declares

For NRI (1.7 and 2.x run with it on; the `nri_socket` fixture skips on 1.6):

    @pytest.mark.runtimes("1.7", "2")
    def test_y(containerd, nri_socket, containerd_cri):
        ...  # a plugin dials nri_socket; the runtime calls it on the next CreateContainer

A plugin a test connects must be gone when the test ends: the session's containerd serves other tests.
Tests must never call PullImage (see crihook.simnode.containerd). What only the tests need lives here.
"""

from __future__ import annotations

import grpc

# re-exported: the tests import the harness from here
from crihook.base.oci import (  # noqa: F401
    ANNOTATION_REF_NAME,
    MEDIA_CONFIG,
    MEDIA_LAYER,
    MEDIA_MANIFEST,
    LayerFile,
    layer_tar,
    oci_archive,
)
from crihook.simnode.containerd import (  # noqa: F401
    BUSYBOX_IMAGE,
    CGROUP_ROOT,
    PAUSE_SOURCE,
    RUNTIMES,
    Containerd,
    Runtime,
    cgroup_hierarchies,
    is_static_elf,
    missing_requirements,
    mounts_below,
    running_containerd,
    runtime,
    shim_pids,
)


def cut_by_deadline(error: grpc.RpcError) -> bool:
    """True when a call failed because its deadline ran out. containerd 1.7+/2.x (grpc-go) reset the
    stream with CANCEL when their copy of the deadline passes, which races the client's own timer:
    the client reports CANCELLED when the reset arrives first, DEADLINE_EXCEEDED otherwise."""
    code = error.code()
    return code == grpc.StatusCode.DEADLINE_EXCEEDED or (
        code == grpc.StatusCode.CANCELLED and "RST_STREAM" in (error.details() or "")
    )
