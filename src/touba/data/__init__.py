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
from touba.data._erase import ErasureReceipt, erase_user, verify_erased
from touba.data._export import export_records, write_export
from touba.data._format import (
    FORMAT_VERSION,
    ExportFileInvalid,
    ImportConflict,
    ImportLimitExceeded,
)
from touba.data._import import ImportReport, import_records
from touba.data._owned import Owned, owned_by
from touba.data._retention import apply_retention
from touba.data._stores import Stores
from touba.memory._retention import Retention, RetentionReport

__all__ = [
    "CopyIssue",
    "CopyReport",
    "ErasureReceipt",
    "ExportFileInvalid",
    "FORMAT_VERSION",
    "ImportConflict",
    "ImportLimitExceeded",
    "ImportReport",
    "Owned",
    "Retention",
    "RetentionReport",
    "Stores",
    "VerifyMismatch",
    "VerifyReport",
    "apply_retention",
    "conversation_digest",
    "copy_stores",
    "copy_worker_id",
    "erase_user",
    "export_records",
    "import_records",
    "owned_by",
    "verify_copy",
    "verify_erased",
    "write_export",
]
