"""What the ``dramatiq-guard`` command and the web dashboard show (views: dicts of JSON values) and do."""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from dramatiq_guard.backends.base import GuardBackend, Handoff, KeyState, KeySummary, WaiterPeek
from dramatiq_guard.bounds import MAX_COUNT

if TYPE_CHECKING:
    from dramatiq import Broker

    from dramatiq_guard.ledger import Ledger

#: The kinds of guard keys, by the prefix the middlewares give them.
KINDS = ("dedup", "mutex", "concurrency", "throttle", "debounce")

#: How many characters of a waiter's arguments a view shows.
ARGS_CHARS = 120


def format_ms(ms: int | None) -> str:
    """A duration for people: ``2.5s``, ``4m05s``, ``3h10m``, ``2d04h``; ``lapsed`` below 0."""
    if ms is None:
        return "-"
    if ms < 0:
        return "lapsed"
    if ms < 10_000:
        return f"{ms / 1000:.1f}s"
    seconds = ms // 1000
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
    if seconds < 86_400:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86_400}d{(seconds % 86_400) // 3600:02d}h"


def format_time(ms: int | None) -> str:
    """A time on the backend's clock (ms since the epoch) for people: ``2026-11-27 12:00:01.250 UTC``."""
    if ms is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


def describe_pending(pending: dict[str, Any] | None) -> str:
    """A :func:`pending_view` in one line (the command's)."""
    if pending is None:
        return "no pending run (the last one was handed to the broker; a send starts the next)"
    actor = f" ({pending['actor']})" if pending["actor"] else ""
    return (
        f"pending run {pending['id'] or '?'}{actor} due in {format_ms(pending['due_in_ms'])}"
        f" (at {format_time(pending['due_ms'])}), {pending['superseded']} send(s) superseded in this burst"
    )


def parse_limit(text: str) -> int | None:
    """``text`` as a limit (an integer from 0 to :data:`~dramatiq_guard.bounds.MAX_COUNT`), else None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 <= value <= MAX_COUNT else None


def indexed_keys(backend: GuardBackend, pattern: str = "*") -> list[str]:
    """The keys of the backend's indexes (keys with waiters or a run-time limit) matching ``pattern``."""
    # Not fnmatchcase(), whose cache keeps 32,768 patterns: the dashboard's readers choose them.
    match = re.compile(fnmatch.translate(pattern)).match
    return [k for k in dict.fromkeys([*backend.waiting_keys(), *backend.limit_keys()]) if match(k)]


def kind_of(key: str) -> str:
    """One of :data:`KINDS` (by the key's prefix), else ``other``."""
    prefix = key.partition(":")[0]
    if prefix == "concurrency-default":
        return "concurrency"
    return prefix if prefix in KINDS else "other"


def describe_payload(payload: bytes | None) -> tuple[str | None, str | None]:
    """A parked message's actor and its first arguments (shortened), or ``(None, None)``; never raises."""
    if payload is None:
        return None, None
    from dramatiq import Message

    try:
        message = Message.decode(payload)
    except Exception:
        return None, "(cannot decode the message)"
    parts = [json.dumps(arg, default=repr) for arg in message.args[:3]]
    parts.extend(f"{name}={json.dumps(value, default=repr)}" for name, value in message.kwargs.items())
    text = ", ".join(parts)
    if len(text) > ARGS_CHARS or len(message.args) > 3:
        text = text[:ARGS_CHARS] + "…"
    return message.actor_name, text


def _waiter_view(peek: WaiterPeek, now: int) -> dict[str, Any]:
    actor, args = describe_payload(peek.payload)
    return {
        "id": peek.waiter_id,
        "since_ms": peek.since_ms,
        "waited_ms": now - peek.since_ms,
        "parked": peek.payload is not None,
        "actor": actor or peek.info,
        "args": args,
    }


def pending_view(summary: KeySummary, now: int) -> dict[str, Any] | None:
    """A debounce key's pending run (its first waiter), or None if none waits (docs/command.md)."""
    if not summary.waiters:
        return None
    first = summary.first[0] if summary.first else None
    actor, args = describe_payload(None if first is None else first.payload)
    due = summary.due_ms
    return {
        "id": None if first is None else first.waiter_id,
        "actor": actor,
        "args": args,
        "sent_ms": None if first is None else first.since_ms,
        "due_ms": due,
        "due_in_ms": None if due is None else due - now,
        "superseded": summary.superseded or 0,
    }


def key_view(key: str, state: KeyState, now: int, summary: KeySummary) -> dict[str, Any]:
    """One key as ``inspect --json`` and the dashboard's key page show it (``now``: the backend's clock)."""
    reserved = set(state.reserved)
    info = {holder: (since, actor) for holder, since, actor in state.holder_info}
    holders = [
        {
            "holder": holder,
            "deadline_ms": deadline,
            "lease_left_ms": deadline - now,
            "reserved": holder in reserved,
            "actor": info.get(holder, (None, None))[1],
            "since_ms": info.get(holder, (None, None))[0],
        }
        for holder, deadline in state.holders
    ]
    parked = sum(1 for _, _, is_parked in state.waiters if is_parked)
    oldest = summary.oldest_since_ms
    view = {
        "key": key,
        "kind": kind_of(key),
        "limit": state.limit,
        "holders": holders,
        "waiters": {
            "count": summary.waiters,
            "parked": parked,  # of the listed ones ("ids")
            "blocking": len(state.waiters) - parked,
            "oldest_age_ms": None if oldest is None else now - oldest,
            "ids": [waiter for waiter, _, _ in state.waiters],
            "first": [_waiter_view(peek, now) for peek in summary.first],
        },
        "token": state.token,
        "recorded_limit": summary.recorded_limit,
        "limit_in_force": state.limit if state.limit is not None else summary.recorded_limit,
    }
    if view["kind"] == "throttle":  # its holders are the starts in the window
        starts, opens_at = state.window()
        view["window"] = {"starts": starts, "opens_in_ms": None if opens_at is None else opens_at - now}
    if view["kind"] == "debounce":
        pending = view["pending"] = pending_view(summary, now)
        if pending is not None and pending["id"] is None and state.waiters:  # none described (--waiters 0)
            pending["id"], pending["sent_ms"] = state.waiters[0][:2]
    return view


#: How many waiters of a key the command and the dashboard list (by id); the count is of all.
LISTED_WAITERS = 1000


def key_views(
    backend: GuardBackend, keys: list[str], *, waiters: int = 100
) -> tuple[int, list[dict[str, Any]]]:
    """The backend's clock and :func:`key_view` of each of ``keys`` (ValueError if one is not a guard key),
    with its first ``waiters`` described."""
    summaries = backend.summaries(keys, waiters=waiters)
    now = backend.now_ms()
    return now, [
        key_view(key, backend.inspect(key, waiters=LISTED_WAITERS), now, summary)
        for key, summary in zip(keys, summaries, strict=True)
    ]


def summary_view(summary: KeySummary, now: int) -> dict[str, Any]:
    """One row of the overview (``inspect --summary --json``, the dashboard's overview)."""
    in_force = summary.limit_in_force
    return {
        "key": summary.key,
        "kind": kind_of(summary.key),
        "holders": summary.holders,
        "waiters": summary.waiters,
        "reserved": summary.reserved,
        "oldest_age_ms": None if summary.oldest_since_ms is None else now - summary.oldest_since_ms,
        "limit": summary.limit,
        "recorded_limit": summary.recorded_limit,
        "limit_in_force": in_force,
        "halted": in_force == 0,
        "at_limit": in_force is not None and in_force > 0 and summary.holders >= in_force,
    }


def _attention(row: dict[str, Any]) -> tuple[bool, int, bool, bool, str]:
    """Sort key, most in need of a look first: halted with waiters, oldest wait, at the limit, halted."""
    age = row["oldest_age_ms"]
    return (
        not (row["halted"] and row["waiters"]),
        -(age if age is not None else -1),
        not row["at_limit"],
        not row["halted"],
        row["key"],
    )


def overview(
    backend: GuardBackend,
    *,
    pattern: str = "*",
    kind: str | None = None,
    page: int = 1,
    per_page: int | None = None,
) -> dict[str, Any]:
    """Every indexed key matching ``pattern`` (and ``kind``) with holders, waiters or a run-time limit,
    most in need of a look first: page ``page`` of ``per_page`` rows (None: all), as ``now_ms``, ``total``,
    ``counts`` (per kind), ``page``, ``pages`` and ``keys`` (a debounce key's with its ``pending`` run)."""
    keys = indexed_keys(backend, pattern)
    if kind is not None:
        keys = [k for k in keys if kind_of(k) == kind]
    now = backend.now_ms()
    rows = [summary_view(s, now) for s in backend.summaries(keys)]
    rows = [r for r in rows if r["holders"] or r["waiters"] or r["limit"] is not None]
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        entry = counts.setdefault(row["kind"], {"keys": 0, "holders": 0, "waiters": 0})
        entry["keys"] += 1
        entry["holders"] += row["holders"]
        entry["waiters"] += row["waiters"]
    rows.sort(key=_attention)
    pages = 1 if per_page is None else max(1, -(-len(rows) // per_page))
    page = min(max(1, page), pages)
    shown = rows if per_page is None else rows[(page - 1) * per_page : page * per_page]
    debounced = [row for row in shown if row["kind"] == "debounce"]
    # Their first waiter's message too (the other rows' are not read: a payload may be large).
    for row, summary in zip(
        debounced, backend.summaries([r["key"] for r in debounced], waiters=1), strict=True
    ):
        row["pending"] = pending_view(summary, now)
    return {"now_ms": now, "total": len(rows), "counts": counts, "page": page, "pages": pages, "keys": shown}


# -- the ledger -----------------------------------------------------------------


def _record_view(record: Any) -> dict[str, Any]:
    fields = dataclasses.asdict(record)
    return {
        name: value.isoformat() if hasattr(value, "isoformat") else value for name, value in fields.items()
    }


def ledger_view(
    ledger: Ledger, *, states: Iterable[str] = ("in_progress", "failed"), limit: int = 50
) -> dict[str, Any]:
    """Counts by state, and the last ``limit`` rows of each of ``states`` (``ledger list --json``)."""
    return {
        "counts": ledger.counts(),
        "rows": {state: [_record_view(r) for r in ledger.rows(state=state, limit=limit)] for state in states},
    }


def ledger_row(ledger: Ledger, key: str) -> dict[str, Any] | None:
    """One ledger row by its idempotency key (``ledger show --json``), or None."""
    record = ledger.get(key)
    return None if record is None else _record_view(record)


# -- the two writes -------------------------------------------------------------

#: Puts handed-off parked messages back on the app's broker and confirms them.
Requeue = Callable[[Sequence[Handoff]], None]


def load_broker(spec: str) -> Broker:
    """The broker named by ``MODULE:ATTR`` (the current directory importable); else a ValueError."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--broker must be MODULE:ATTR (e.g. myapp.tasks:broker), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        broker = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--broker {spec}: {e}") from None
    from dramatiq import Broker

    if not isinstance(broker, Broker):
        raise ValueError(f"--broker {spec} is a {type(broker).__name__}, not a dramatiq Broker")
    return broker


def broker_requeue(broker: Broker | str | None, backend: GuardBackend) -> Requeue | None:
    """How to re-enqueue hand-offs on ``broker`` (or ``MODULE:ATTR``) as a worker would (None: no broker);
    a ValueError as :func:`load_broker`, or a ConfigurationError if the broker has no route."""
    from dramatiq_guard.delivery import courier_for
    from dramatiq_guard.resolve import route_of

    if broker is None:
        return None
    if isinstance(broker, str):
        broker = load_broker(broker)
    backend.route = route_of(broker)

    def requeue(handoffs: Sequence[Handoff]) -> None:
        for handoff in handoffs:
            courier_for(broker, backend, handoff.key).deliver([handoff])

    return requeue


def deliver(backend: GuardBackend, handoffs: Sequence[Handoff], requeue: Requeue | None) -> str:
    """Put handed-off parked messages back on the broker, or leave them reserved; say which."""
    parked = [h for h in handoffs if h.payload is not None]
    woken = len(handoffs) - len(parked)
    notes = []
    if woken:
        notes.append(f"{woken} blocking waiter(s) woken")
    if not parked:
        return "; ".join(notes) or "no waiter was handed a slot"
    if requeue is None:
        ttl = format_ms(backend.handoff_ttl_ms)
        notes.append(
            f"{len(parked)} parked message(s) handed a slot and left reserved: a worker's sweep "
            f"re-enqueues them once the reservation lapses (~{ttl}); pass --broker to re-enqueue now"
        )
        return "; ".join(notes)
    requeue(parked)
    # A hand-off whose re-enqueue failed is still an unconfirmed reservation: it lapses back by itself.
    failed = [h.waiter_id for h in parked if h.waiter_id in backend.inspect(h.key).reserved]
    notes.append(f"{len(parked) - len(failed)} parked message(s) re-enqueued")
    if failed:
        notes.append(f"could not re-enqueue {', '.join(failed)}: left reserved (see the log)")
    return "; ".join(notes)


def set_limit(backend: GuardBackend, key: str, limit: int, requeue: Requeue | None) -> list[str]:
    """Set ``key``'s run-time limit (0 halts it), hand new slots to waiters; returns what was done."""
    # The default is only used if no run-time limit is in force; here one always is.
    result = backend.set_limit(key, limit, default=0)
    lines = [f"{key}: limit set to {limit}" + (" (halted)" if limit == 0 else "")]
    if result.handoffs:
        lines.append(deliver(backend, result.handoffs, requeue))
    return lines


def releasable(state: KeyState) -> list[str]:
    """The holders a forced release releases: every one but unconfirmed hand-offs."""
    reserved = set(state.reserved)
    return [holder for holder, _ in state.holders if holder not in reserved]


def release_holders(
    backend: GuardBackend, key: str, holders: Sequence[str], requeue: Requeue | None
) -> list[str]:
    """Release ``holders`` of ``key`` by force (by id) and hand their slots on; returns what was done."""
    released = 0
    handoffs: list[Handoff] = []
    for holder in holders:
        result = backend.release(key, holder, limit=None)
        released += result.released
        handoffs.extend(result.handoffs)
    lines = [f"{key}: released {released} holder(s)"]
    if handoffs:
        lines.append(deliver(backend, handoffs, requeue))
    return lines
