"""The exceptions the CLI turns into a clean message without a traceback: UserError (exit code
2) and Preempted (128 + the signal number, as a shell reports a process a signal ended)."""

import difflib
from collections.abc import Iterable


class UserError(Exception):
  """Bad input from the user: the message names the culprit and the fix."""


class Preempted(Exception):
  """Training stopped on SIGTERM or SIGINT after saving a checkpoint; rerunning resumes."""

  def __init__(self, message: str, *, signum: int):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
  """' Did you mean: a, b?' for the closest names, or '' when none is close."""
  close = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.5)
  return f" Did you mean: {', '.join(close)}?" if close else ""
