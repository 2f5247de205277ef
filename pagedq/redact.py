"""Credentials never reach a log line: ``redact_url`` masks the password of every Redis URL in
a text. Ground floor (imports nothing of pagedq): the client's error messages, the worker's
log processor and the kernels' logs all use it.
"""

from __future__ import annotations

import re

_CREDENTIALS = re.compile(r"((?:rediss?|unix)://)(?:([^:@/\s]*):)?([^@/\s]*)@")


def redact_url(text: str) -> str:
    """``text`` with the password of every Redis URL in it replaced by ``***`` (the user name,
    before a colon, stays: it says which ACL user connected)."""
    return _CREDENTIALS.sub(lambda m: f"{m[1]}{m[2]}:***@" if m[2] is not None
                            else f"{m[1]}***@", text)
