"""The one exception type the CLI turns into a clean message (no traceback, exit code 2)."""

import difflib
from collections.abc import Iterable


class UserError(Exception):
  """Bad input from the user: the message names the culprit and the fix."""


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
  """' Did you mean: a, b?' for the closest names, or '' when none is close."""
  close = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.5)
  return f" Did you mean: {', '.join(close)}?" if close else ""
