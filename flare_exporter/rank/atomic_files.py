"""Writing files that readers may open at any moment: whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def file_name_part(text: str) -> str:
    """`text` (a run id) made safe for a file name: anything but letters, digits, - _ . becomes _."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def write_json_atomically(path: str, document: Any) -> None:
    """Write `document` as JSON to `path` through a temporary file and a rename; OSError on failure."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".flare-", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(document, out, indent=1)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
