"""The panel's "Erase this user" action (``POST /user/erase``), on the owner's page.

- Shown on the page of an owner ``user:<id>`` (or a bare id a host used as owner), never
  of an anonymous ``session:<id>`` owner. The form asks the operator to type the user id
  again; a missing or different id erases nothing ("Nothing erased").
- Checked as every panel action: the operator's session (401) and the form's CSRF token
  (403), before anything is read.
- Runs :func:`touba.erase_user` on the panel's stores: its memory store, its
  decision-history store (when given) and the checkpoint store and resource binding of
  the runtime whose approvals it shows (when given). A user whose conversation a worker
  holds, or whose checkpoint is running, is refused with what to do, unless the operator
  ticks that the workers are stopped (``force=True``).
- Logged on ``touba.panel`` as an operator action with the user's hash and the counts:
  never the user id, never content. The flash message says how many rows went.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response

from touba.data import Stores, erase_user
from touba.errors import DecisionHistoryBusy, InvocationBusy, ToubaError
from touba.panel._routes import _back, _form, _operator, _panel
from touba.panel._state import Panel

__all__ = ["router", "user_of_owner"]

logger = logging.getLogger("touba.panel")
router = APIRouter()


def user_of_owner(owner: str) -> str | None:
    """The user id of an owner string (``user:<id>``, or a bare id); None for an
    anonymous ``session:<id>`` owner, which is no user's."""
    if owner.startswith("session:") or not owner:
        return None
    return owner.removeprefix("user:") or None


def _stores(panel: Panel) -> Stores:
    runtime = panel.approvals
    return Stores(
        memory=panel.memory,
        histories=() if panel.history is None else (panel.history,),
        checkpoints=None if runtime is None else runtime.checkpoints,
        resources=None if runtime is None else runtime.resources,
    )


@router.post("/user/erase")
async def erase(request: Request) -> Response:
    panel = _panel(request)
    form = await _form(request)
    session = _operator(request)
    owner = form.get("owner", "")
    user = user_of_owner(owner)
    if user is None:
        session.flash("error", "Nothing erased: this owner is an anonymous session, no user.")
        return _back("/user", owner=owner)
    if form.get("confirm", "").strip() != user:
        session.flash(
            "error", "Nothing erased: type the user id exactly as shown to confirm the erase."
        )
        return _back("/user", owner=owner, anchor="erase")
    force = form.get("workers_stopped") == "yes"
    try:
        receipt = await erase_user(user, _stores(panel), force=force)
    except (DecisionHistoryBusy, InvocationBusy):
        session.flash(
            "error",
            "Nothing erased: a worker holds one of this user's conversations or runs one of "
            "its checkpoints. Wait for it; if it crashed, stop it, tick that the workers are "
            "stopped, and erase again.",
        )
        return _back("/user", owner=owner, anchor="erase")
    except ToubaError as e:
        session.flash("error", f"The erase stopped ({e.code}); run it again to finish it.")
        return _back("/user", owner=owner, anchor="erase")
    logger.info(
        "user %s erased by the operator: %s",
        receipt.user_hash,
        {store: dict(kinds) for store, kinds in receipt.counts.items()},
    )
    session.flash(
        "ok",
        f"Erased {receipt.total} row(s) of user sha256 {receipt.user_hash[:12]}… "
        f"({receipt.erased_at.isoformat(timespec='seconds')}). Backups are not touched.",
    )
    return _back("/users")
