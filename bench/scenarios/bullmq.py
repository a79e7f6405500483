"""The anchor: BullMQ's add with and without a deduplication id, on the bench's Redis (Node.js)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from pathlib import Path

from bench.core import Context, Figure, scenario

HERE = Path(__file__).resolve().parent.parent / "bullmq"


@scenario("bullmq", title="BullMQ's deduplicated add (Node.js), the anchor", quick=False, order=15)
def bullmq(ctx: Context) -> list[Figure]:
    """BullMQ (``bench/bullmq``: its version pinned in ``package.json``) on the same Redis.

    ``node bench/bullmq/add.mjs``: ``queue.add`` N times, plain, with a new deduplication id each
    time (accepted) and with a taken one (duplicate), taking turns for 5 rounds, medians. Its
    ratios to its own plain add are what dramatiq-guard's ``dedup`` rows are set beside. Needs
    ``node`` and ``npm`` on PATH; ``npm install`` runs in ``bench/bullmq`` the first time (the npm
    registry). Without Node.js the scenario reports nothing.
    """
    if shutil.which("node") is None or shutil.which("npm") is None:
        return []
    if not (HERE / "node_modules" / "bullmq").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=HERE, check=True)
    port = urllib.parse.urlsplit(ctx.redis_url).port
    n = ctx.n(5000, 300)
    out = subprocess.run(
        ["node", "add.mjs", str(port), str(n), "5"], cwd=HERE, check=True, capture_output=True, text=True
    )
    rates = json.loads(out.stdout.strip().splitlines()[-1])
    sized = f"N={n}, median of 5, the kinds of add taking turns"
    return [
        Figure("plain_add_rate", "add rate, plain", rates["plain"], "job/s", detail=sized),
        Figure(
            "accepted_add_rate",
            "add rate, a new deduplication id each add",
            rates["accepted"],
            "job/s",
            vs="bullmq/plain_add_rate",
            detail=sized,
        ),
        Figure(
            "duplicate_add_rate",
            "add rate, a taken deduplication id",
            rates["duplicate"],
            "job/s",
            vs="bullmq/plain_add_rate",
            detail=sized,
        ),
    ]
