"""Errors a user can act on.

`UserError` marks a mistake in the user's input (a policy, a path, a selector). The CLI prints its
message and exits 2 without a traceback; programmatic callers catch it like any ValueError.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in what the user gave us; the message names the problem and the fix."""
