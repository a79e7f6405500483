"""The rows of the idempotency ledger: what one run records, and the statements that write them."""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

from dramatiq_guard.errors import UnstorableResult
from dramatiq_guard.ledger.records import LedgerRecord


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a claimed run does: the token its completion is fenced on, the one it writes, its attempt."""

    expected_token: int
    new_token: int
    attempts: int
    reset: bool  # the row expired: the run takes it over as if it were new


@dataclasses.dataclass(frozen=True)
class Stored:
    """The key was completed: its stored result is the answer, and nothing runs."""

    result: Any


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a key: what its row records, whatever happens to it."""

    key: str
    row_key: str
    actor_name: str
    payload: Any
    fingerprint: str
    holder: str
    retention_ms: int | None

    def row(self, state: str, now: datetime.datetime) -> dict[str, Any]:
        """A new row of this run in ``state``: its first attempt, token 1."""
        return {
            "idempotency_key": self.row_key,
            "state": state,
            "actor_name": self.actor_name,
            "fingerprint": self.fingerprint,
            "payload": self.payload,
            "result": None,
            "error": None,
            "attempts": 1,
            "holder": self.holder,
            "fencing_token": 1,
            "created_at": now,
            "updated_at": now,
            "completed_at": None,
            "expires_at": None,
        }


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def record_of(row: Any) -> LedgerRecord:
    """A row of the table as a :class:`LedgerRecord` (its fields are the columns, ``key`` first)."""
    columns = [field.name for field in dataclasses.fields(LedgerRecord)][1:]
    return LedgerRecord(row.idempotency_key, *(getattr(row, name) for name in columns))


def expiry(now: datetime.datetime, retention_ms: int | None) -> datetime.datetime | None:
    return None if retention_ms is None else now + datetime.timedelta(milliseconds=retention_ms)


def check_storable(result: Any) -> None:
    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnstorableResult(
            f"the actor returned {type(result).__name__} {result!r:.200}, which the idempotency ledger "
            f"cannot store as JSON ({e}); nothing was committed"
        ) from e
