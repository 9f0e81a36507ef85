#!/bin/sh
# Every figure of the allocation results table: `crihook simulate` on the openb trace, one JSON line
# per (workload, policy), 10 seeds each (SEEDS=42-51 by default; PYTHON=.venv/bin/python by default;
# NODES=the node list, TRACE_DIR/openb_node_list_gpu_node.csv by default).
# Usage, from the repository root: bench/simulate_table.sh TRACE_DIR POLICIES [WORKLOADS]
#   bench/simulate_table.sh TRACE_DIR fgd,bestfit,dotprod,random > baselines.jsonl
#   NODES=TRACE_DIR/openb_node_list_gpu_node.csv \
#     bench/simulate_table.sh PINNED_DIR default,fgd "gpuspec10 gpuspec20 gpuspec25 gpuspec33" > pinned.jsonl
set -eu
dir=$1
policies=$2
workloads=${3:-"default gpushare20 gpushare40 gpushare60 gpushare80 gpushare100 multigpu20 multigpu30 multigpu40 multigpu50"}
for w in $workloads; do
    curve=""
    [ "$w" = default ] && curve=--curve
    "${PYTHON:-.venv/bin/python}" -m crihook.cli simulate --nodes "${NODES:-$dir/openb_node_list_gpu_node.csv}" --pods "$dir/openb_pod_list_$w.csv" \
        --policy "$policies" --seeds "${SEEDS:-42-51}" --json $curve
done
