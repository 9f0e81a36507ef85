"""crihook.proto.wire against protobuf's own encoder: the hand-encoded containerd task requests
(proxy/orphans.py) must be bytes protobuf would produce."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import wire
from crihook.proxy.orphans import delete_request, kill_request

IDS = st.text(min_size=1, max_size=200)


@given(IDS, st.integers(1, 2**63 - 1))
def test_string_and_varint_fields_match_protobuf(container_id: str, timeout: int) -> None:
    # StopContainerRequest{container_id: 1 string, timeout: 2 int64}: the same wire types as the task requests
    expected = cri.StopContainerRequest(container_id=container_id, timeout=timeout).SerializeToString()
    assert wire.length_delimited(1, container_id.encode()) + wire.uint(2, timeout) == expected


@given(IDS)
def test_task_requests_carry_the_id_then_sigkill_to_all(container_id: str) -> None:
    head = cri.RemoveContainerRequest(container_id=container_id).SerializeToString()  # field 1, string
    assert delete_request(container_id) == head
    assert kill_request(container_id) == head + bytes([3 << 3, 9, 4 << 3, 1])
