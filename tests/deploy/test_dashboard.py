"""The Grafana dashboards in deploy/grafana: every query names metrics crihook exports, with labels
those metrics have, so a renamed metric or label breaks this test rather than a panel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crihook.base import metrics

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "grafana").glob("*.json"))
# what Prometheus adds to every scraped series, and the node daemons' registry label (node)
TARGET_LABELS = {"instance", "job", "node"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_METRIC = re.compile(r"\b(crihook_[a-zA-Z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Every series name crihook exposes -> the labels it carries (a histogram's with its suffixes)."""
    names: dict[str, set[str]] = {}
    for m in metrics.REGISTRY:
        labels = set(m.labels) | TARGET_LABELS
        if m.kind == "histogram":
            for suffix in _HISTOGRAM_SUFFIXES:
                names[m.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
        else:
            names[m.name] = labels
    return names


def queries(doc: Any) -> Iterator[str]:
    """Every PromQL text in a dashboard: panel targets and template variables."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            # a variable's "query" is a data source type ("prometheus") or PromQL
            if isinstance(value, str) and (key in ("expr", "definition") or (key == "query" and "(" in value)):
                yield value
            else:
                yield from queries(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from queries(item)


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_exported_metrics_and_their_labels(path: Path) -> None:
    doc = json.loads(path.read_text())
    names = exported()
    found = list(queries(doc))
    assert len(found) >= len(doc["panels"])
    for expr in found:
        used = _METRIC.findall(expr)
        assert used, f"{path.name}: {expr!r} names no crihook metric"
        labels_of_query: set[str] = set()
        for name, selector in used:
            assert name in names, f"{path.name}: {expr!r} names {name}, which crihook does not export"
            matched = set(_MATCHER.findall(selector))
            assert matched <= names[name], f"{path.name}: {name} has no label(s) {matched - names[name]}"
            labels_of_query |= names[name]
        for group in _GROUPING.findall(expr):
            grouped = {g.strip() for g in group.split(",") if g.strip()}
            assert grouped <= labels_of_query, f"{path.name}: {expr!r} groups by unknown {grouped - labels_of_query}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_are_laid_out_and_identified_once(path: Path) -> None:
    doc = json.loads(path.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        assert p["title"] and p["targets"] and {"x", "y", "w", "h"} <= set(p["gridPos"])
        assert all(t["refId"] for t in p["targets"])


def test_the_checker_catches_a_wrong_name() -> None:
    names = exported()
    assert "crihook_gpu_memory_used_bytes" in names and "crihook_gpu_usage_collection_cpu_seconds_sum" in names
    wrong = _METRIC.findall('sum by (pod) (crihook_gpu_memory_use_bytes{pod="x"})')
    assert wrong and wrong[0][0] not in names


def test_node_namespace_pod_variables_and_an_allocated_versus_used_view() -> None:
    """The GPU usage dashboard filters by node (crihook's own label), namespace and pod, and shows
    per pod what the scheduler allocated beside what the processes use."""
    doc = json.loads((DASHBOARDS[0].parent / "crihook-gpu-usage.json").read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert {"node", "namespace", "pod"} <= set(variables)
    assert "node)" in variables["node"]["definition"]
    per_pod = [
        p
        for p in doc["panels"]
        if any('pod=~"$pod"' in t["expr"] and "by (namespace, pod)" in t["expr"] for t in p["targets"])
    ]
    pairs = {
        tuple(sorted(m for t in p["targets"] for m in _METRIC.findall(t["expr"]) for m in [m[0]])) for p in per_pod
    }
    assert ("crihook_gpu_granted_memory_bytes", "crihook_gpu_memory_used_bytes") in pairs
    assert ("crihook_gpu_granted_core_ratio", "crihook_gpu_sm_utilization_ratio") in pairs
