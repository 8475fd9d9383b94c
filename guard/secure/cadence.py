"""How often background securing may push, from the destination: every complete save to a folder, under the
commit rate limit on the Hub.

- **Folder**: 0 s, every complete save is secured. Files unchanged since the last push are hard-linked from the
  previous secured copy (``guard.secure.dest.folder``), so a push costs one read of the checkpoint and a copy of what
  changed; a loop that saves in place (``ckpt.pt``) then never loses a good save to an interval.
- **Hub**: the larger of two bounds, so that the guard's own commits use a bounded share of the repository's commit
  budget and the time spent pushing stays a fraction of the run:

  - the rate bound: the Hub refuses more than ``HUB_COMMITS_PER_HOUR`` = 128 commits per hour on a repository
    (the Hub's 429 answer: "You have exceeded the rate limit for repository commits (128 per hour)", free tier).
    Each checkpoint push makes ``COMMITS_PER_PUSH`` = 2 commits (the files, then the record written after
    verification, ``securer.Securer.push_checkpoint``); background pushes may use ``HUB_SHARE`` = a quarter of the
    budget, which leaves the rest to the Trainer's own ``push_to_hub``, the final push and retries:
    ``3600 * 2 / (128 * 0.25)`` = 225 s;
  - the time bound: ``PUSH_TIME_FACTOR`` = 3 times the last measured push (upload and verification), so that at
    most a third of the wall time has a push in flight (its upload shares the job's network and disk).

  With many nodes each putting its own part at a Hub repo (``"hub-parts"``), a push is ``COMMITS_PER_PUSH``
  commits on each node (the part's files, then its manifest) and one record commit: ``2 * nodes + 1`` commits, so
  node 0's rate bound grows with the node count (two nodes: 562 s; eight: 1,912 s); the other nodes push each step
  node 0 put at once (``"parts"``).

An explicit ``--push-interval`` wins over both (the caller passes it instead of asking here).

The nodes of a many-node job meet through the destination's listing (``guard.secure.follow``): at a Hub repo a
listing is API requests, which the Hub limits to ``HUB_API_REQUESTS_PER_5MIN`` = 1,000 per 5-minute window for a
free user (huggingface/hub-docs, docs/hub/rate-limits.md, September 2025; PRO 2,500). A node listing every 0.5 s
(about 3 requests: the run's steps, then each step's manifests) made 1,800 requests in 5 minutes on its own, so
``listing_interval_s`` spaces the listings of the nodes that follow node 0 so that together they use ``HUB_SHARE``
of that budget: 3.6 s each on two nodes, 25 s on eight.
"""

from __future__ import annotations

import math

from guard.core.durations import format_duration_s

__all__ = [
    "COMMITS_PER_PUSH",
    "HUB_API_REQUESTS_PER_5MIN",
    "HUB_COMMITS_PER_HOUR",
    "HUB_REQUESTS_PER_LISTING",
    "HUB_SHARE",
    "PUSH_STALL_S",
    "PUSH_TIME_FACTOR",
    "background_interval_s",
    "background_said",
    "listing_interval_s",
]

#: The Hub's commit rate limit per repository (commits per hour; the 429 message of the Hub, free tier).
HUB_COMMITS_PER_HOUR = 128
#: The share of that budget background securing may use (and of the API budget, the nodes' listings).
HUB_SHARE = 0.25
#: The Hub's API rate limit for a free user: requests per 5-minute window (tree listings count; huggingface/hub-docs
#: docs/hub/rate-limits.md, September 2025).
HUB_API_REQUESTS_PER_5MIN = 1000
#: Requests one listing of a run's parts costs at a Hub repo (the run's steps, then each step's manifests: 1 + steps).
HUB_REQUESTS_PER_LISTING = 3
#: Commits per checkpoint push: the files, then the record after verification.
COMMITS_PER_PUSH = 2
#: The interval is at least this many times the measured push time.
PUSH_TIME_FACTOR = 3.0
#: A push that moved no byte for this long is stalled (``--push-stall``, seconds): logged, and replaced by a newer
#: checkpoint's push when there is one (``guard.secure.plan``). Under the workers' per-request read bound
#: (``hubhttp.REQUEST_TIMEOUTS_S``, 60 s), over the few seconds the Hub takes to answer a commit.
PUSH_STALL_S = 30.0


def background_interval_s(destination_kind: str, *, measured_push_s: float | None = None,
                          commits_per_hour: float = HUB_COMMITS_PER_HOUR, share: float = HUB_SHARE,
                          commits_per_push: int = COMMITS_PER_PUSH, nodes: int = 1) -> float:
    """The least time between two background push starts for a destination, in seconds.

    Args:
        destination_kind: ``dest.base.Destination.kind``: ``"folder"``, ``"hub"`` or ``"s3"``; ``"parts"``: every node
            of a many-node job puts its own part of each checkpoint (each complete save, so that all put the same
            steps); ``"hub-parts"``: the same at a Hub repo, under its commit rate limit.
        measured_push_s: the last background push's duration (``PushResult.elapsed_s``), or None before the
            first one.
        commits_per_hour: the destination's commit rate limit (default ``HUB_COMMITS_PER_HOUR``).
        share: the share of it background pushes may use (default ``HUB_SHARE``), in (0, 1].
        commits_per_push: commits each push makes on each node (default ``COMMITS_PER_PUSH``).
        nodes: the job's node count (``"hub-parts"``: the repo gets ``commits_per_push * nodes + 1`` commits a
            push, the record included); default 1.

    Returns:
        0.0 for a folder and for ``"parts"`` (every complete save); ``PUSH_TIME_FACTOR * measured_push_s`` for S3
        (0.0 before the first push); for the Hub ``max(3600 * commits_per_push / (commits_per_hour *
        share), PUSH_TIME_FACTOR * measured_push_s)``, with ``commits_per_push * nodes + 1`` commits for
        ``"hub-parts"``.

    Raises:
        ValueError: an unknown ``destination_kind``, or a rate or share that is not positive.
    """
    if destination_kind in ("folder", "parts"):  # parts: many nodes put the same steps' parts (guard.secure.nodes)
        return 0.0
    measured = measured_push_s if measured_push_s is not None and math.isfinite(measured_push_s) else 0.0
    if destination_kind == "s3":  # no commit rate limit; each push is paid requests: not more than a third of the time
        return PUSH_TIME_FACTOR * max(0.0, measured)
    if destination_kind == "hub-parts":  # every node's part (files, manifest), then one record commit
        commits_per_push, destination_kind = commits_per_push * max(1, nodes) + 1, "hub"
    if destination_kind != "hub":
        raise ValueError(f"unknown destination kind {destination_kind!r}: expected 'folder', 'hub' or 's3'")
    if not (commits_per_hour > 0 and 0 < share <= 1 and commits_per_push > 0):
        raise ValueError("commits_per_hour, share and commits_per_push must be positive (share at most 1)")
    rate_bound_s = 3600.0 * commits_per_push / (commits_per_hour * share)
    return max(rate_bound_s, PUSH_TIME_FACTOR * max(0.0, measured))


def listing_interval_s(destination_kind: str, *, nodes: int, least_s: float,
                       requests_per_5min: float = HUB_API_REQUESTS_PER_5MIN, share: float = HUB_SHARE) -> float:
    """The least time between two listings of the nodes' parts by one node that follows node 0 (seconds).

    Args:
        destination_kind: ``"folder"``, ``"hub"`` or ``"s3"``.
        nodes: the job's node count (``nodes - 1`` nodes follow).
        least_s: the interval where the destination sets no bound (``follow.LIST_EVERY_S``).
        requests_per_5min: the Hub's API rate limit (default ``HUB_API_REQUESTS_PER_5MIN``).
        share: the share of it the listings may use together (default ``HUB_SHARE``).

    Returns:
        ``least_s`` for a folder and S3; for the Hub at least ``HUB_REQUESTS_PER_LISTING * (nodes - 1)`` requests
        over ``share`` of the rate limit: 3.6 s on two nodes.
    """
    if destination_kind != "hub":
        return least_s
    per_s = requests_per_5min / 300.0 * share
    return max(least_s, HUB_REQUESTS_PER_LISTING * max(1, nodes - 1) / per_s)


def background_said(destination_kind: str | None, *, push_interval_s: float | None, nodes: int) -> str:
    """How often background pushes may come, for the log: ``push_interval_s`` (``--push-interval``; None: from the
    destination and the measured push time, :func:`background_interval_s`, at a Hub repo), else every save."""
    if push_interval_s is None and destination_kind in ("hub", "hub-parts"):
        least_s = background_interval_s(str(destination_kind), nodes=nodes)
        return (f"at most one push every {format_duration_s(least_s)}, longer "
                f"when a push takes more than 1/{PUSH_TIME_FACTOR:.0f} of that (the Hub's commit rate limit)")
    if push_interval_s:
        return f"at most one push every {format_duration_s(push_interval_s)}"
    return "every complete save"
