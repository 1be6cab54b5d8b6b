"""Where the limits live (this module only re-exports them, for older imports):

- ``quota.py``: ``Quota``, the bytes each owner keeps resident;
- ``admission.py``: ``check_upload``, an upload admitted before its buffers exist;
- ``owners.py``: ``OwnerLimits``, streams, uploads and staged bytes per owner;
- ``guard.py``: ``GuardInterceptor``, the in-flight bound and the checks every call passes.
"""

from __future__ import annotations

from coliworker.server.admission import check_upload
from coliworker.server.guard import GuardInterceptor
from coliworker.server.quota import Quota

__all__ = ["GuardInterceptor", "Quota", "check_upload"]
