"""A user's data across every store: erase, export and import, copy between stores,
retention.

The operations an operator runs over a deployment's stores together (the memory
store, the history stores, the checkpoint store and the resource binding), built on
each store's own primitives. It sits above :mod:`touba.memory` and below the CLI and
the panel, which both call it.
"""

from touba.data._copy import (
    CopyIssue,
    CopyReport,
    VerifyMismatch,
    VerifyReport,
    conversation_digest,
    copy_stores,
    copy_worker_id,
    verify_copy,
)
from touba.data._stores import Stores

__all__ = [
    "CopyIssue",
    "CopyReport",
    "Stores",
    "VerifyMismatch",
    "VerifyReport",
    "conversation_digest",
    "copy_stores",
    "copy_worker_id",
    "verify_copy",
]
