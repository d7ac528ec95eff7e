"""Errors a user can act on.

`UserError` marks a mistake in the user's input (a policy, a path, a selector). The CLI prints its
message and exits 2 without a traceback; programmatic callers catch it like any ValueError.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in what the user gave us; the message names the problem and the fix."""


def missing_source(text: str, what: str = "model folder") -> UserError:
    """The error for a model path that does not exist, with the hub-id hint where it looks like one."""
    looks_like_hub = text.count("/") == 1 and not text.startswith((".", "/"))
    return UserError(
        f"{text}: no such {what}"
        + (" (hub ids are not downloaded: download the model first and pass its local folder)"
           if looks_like_hub else "")
    )
