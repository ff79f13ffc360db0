"""Batch records and their partial result files, kept on disk.

`<root>/batches/<id>.json` is the Batch object as the API returns it;
`<id>.output.jsonl` and `<id>.errors.jsonl` collect result lines while the
batch runs, and become files of the Files API when it ends. Everything a
restart needs to resume is here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pyserve.storage.files import time_ordered_hex

BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")


class BatchNotFound(KeyError):
    pass


def new_batch_id() -> str:
    return f"batch_{time_ordered_hex()}"


class BatchStore:
    def __init__(self, root: str | Path):
        self.dir = Path(root) / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, batch_id: str, suffix: str) -> Path:
        if not BATCH_ID.match(batch_id):
            raise BatchNotFound(batch_id)
        return self.dir / f"{batch_id}{suffix}"

    def save(self, record: dict) -> None:
        # Small and frequent: a synchronous write-then-rename keeps it atomic.
        path = self._path(record["id"], ".json")
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)

    def load_all(self) -> dict[str, dict]:
        records = {}
        for path in self.dir.glob("batch_*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            records[record["id"]] = record
        return records

    def output_path(self, batch_id: str) -> Path:
        return self._path(batch_id, ".output.jsonl")

    def errors_path(self, batch_id: str) -> Path:
        return self._path(batch_id, ".errors.jsonl")

    def finished_lines(self, batch_id: str) -> dict[str, bool]:
        """custom_id -> succeeded, for result lines already written. A line
        cut short by a crash is removed, so appends continue cleanly."""
        done: dict[str, bool] = {}
        for path, ok in ((self.output_path(batch_id), True), (self.errors_path(batch_id), False)):
            if not path.exists():
                continue
            data = path.read_bytes()
            whole = data[: data.rfind(b"\n") + 1]
            if len(whole) != len(data):
                path.write_bytes(whole)
            for line in whole.splitlines():
                done[json.loads(line)["custom_id"]] = ok
        return done
