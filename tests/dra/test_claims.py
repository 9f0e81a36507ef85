"""Which of a pod's claims its containers hold together: numbered together in their CDI specs."""

from __future__ import annotations

from crihook.dra.claims import pod_groups
from tests.support.draclaims import pod


def test_claims_every_container_holds_together_are_one_group() -> None:
    p = pod("p", {"main": ["a", "b"], "side": ["a", "b"]}, {"a": "p-a-x1", "b": "p-b-x2"})
    groups, problems = pod_groups(p, {"p-a-x1": "ua", "p-b-x2": "ub"})
    assert groups == {"ua": ("ua", "ub"), "ub": ("ua", "ub")} and problems == []


def test_a_claim_held_with_different_claims_stays_alone() -> None:
    p = pod("p", {"main": ["a", "b"], "side": ["a"], "third": ["c"]}, {"a": "ra", "b": "rb", "c": "rc"})
    groups, problems = pod_groups(p, {"ra": "ua", "rb": "ub", "rc": "uc"})
    assert groups == {"ua": ("ua",), "ub": ("ua", "ub"), "uc": ("uc",)}
    assert problems == ["claim ra: its containers hold it with different claims; numbered alone"]


def test_claims_of_other_drivers_and_unused_claims() -> None:
    p = pod("p", {"main": ["a", "other"]}, {"a": "ra", "other": "ro", "unused": "ru"})
    groups, _ = pod_groups(p, {"ra": "ua", "ru": "uu"})
    assert groups == {"ua": ("ua",), "uu": ("uu",)}


def test_a_claim_named_in_the_pod_spec_directly() -> None:
    p = pod("p", {"main": ["a", "b"]}, {"a": "ra", "b": "rb"})
    p["spec"]["resourceClaims"][0] = {"name": "a", "resourceClaimName": "shared"}
    p["status"]["resourceClaimStatuses"] = p["status"]["resourceClaimStatuses"][1:]
    groups, _ = pod_groups(p, {"shared": "us", "rb": "ub"})
    assert groups["us"] == ("ub", "us")
