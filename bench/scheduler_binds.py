"""1,000 pods scheduled the way kube-scheduler drives the extender (filter, prioritize, bind the best
node; 32 binds in flight), against the fake API server, with the scheduler restarted halfway. Prints
what was bound and what the API server holds, checked GPU by GPU.

    python bench/scheduler_binds.py [--pods 1000] [--nodes 64] [--workers 32]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.bindrun import run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=64, help="8-GPU nodes")
    ap.add_argument("--workers", type=int, default=32, help="binds in flight")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # refused binds are expected
    r = run(args.pods, args.nodes, args.workers)
    print(f"pods {r.pods} on {args.nodes} nodes x 8 GPUs, {args.workers} in flight, {r.seconds:.1f} s")
    print(
        f"bound {r.bound}, refused (no node fits) {r.refused}, lost races retried {r.retries}, "
        f"still lost {len(r.lost_races)}, other errors {len(r.errors)}"
    )
    print(
        f"restart halfway: allocator held {r.state_before_restart} pods; rebuilt the same state: "
        f"{r.rebuilt_same} in {r.restart_seconds:.2f} s"
    )
    print(
        f"GPUs checked {r.gpus_checked}: over-committed {len(r.over_committed)}, whole GPU shared "
        f"{len(r.shared_whole)}, bound without annotation {len(r.unannotated_bound)}, "
        f"allocator vs annotations mismatches {r.held_mismatch}"
    )
    bad = r.errors or r.over_committed or r.shared_whole or r.unannotated_bound or r.held_mismatch
    return 1 if bad or not r.rebuilt_same else 0


if __name__ == "__main__":
    sys.exit(main())
