"""The block that keeps a remote work area's task results, with credentials by reference.

Prefect stores a result-storage block's settings on its server and shows them in the UI, so
the settings here are the job's storage options without secrets (`zerosafe_app.flows.config.JobConfig`
refuses those); a `credentials` reference in them is resolved where results are read or
written (`zerosafe_app.tasks.credentials`), and S3 options get zerosafe's meaning (`region`, no listing
cache) as everywhere else.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from prefect.filesystems import RemoteFileSystem

from zerosafe_app.tasks.credentials import storage_for

__all__ = ["WorkAreaResults"]


class WorkAreaResults(RemoteFileSystem):
    """Task results and cache records under a job's remote work area (`WORK/results`)."""

    _block_type_name = "zerosafe work area results"
    _description = "Task results of a zerosafe job, in its remote work area."

    @property
    def filesystem(self) -> Any:
        if not self._filesystem:
            scheme = urllib.parse.urlsplit(self.basepath).scheme
            self._filesystem, _ = storage_for(self.settings).filesystem(f"{scheme}://")
        return self._filesystem
