"""What every lla binary does with an error it can name: one line on stderr, a non-zero exit.

  with cli.one_line_errors(ReplayInputError, BudgetError, ...):
    ...

An input error (a file that is missing, a value out of range, a directory in use) is the
user's to fix, so it is reported as one line naming the problem, never as a traceback; any
other exception is a bug and keeps its traceback. The kinds are listed by each binary: only
those its inputs can raise before anything is written.
"""

from __future__ import annotations

import contextlib


def one_line(error: BaseException) -> str:
  """The message of `error` as one line (a KeyError's key unquoted; several lines joined)."""
  text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
  lines = [line.strip() for line in str(text).splitlines() if line.strip()]
  return " ".join(lines) or type(error).__name__


@contextlib.contextmanager
def one_line_errors(*kinds: type[BaseException], prefix: str = "error"):
  """Turns an exception of `kinds` into SystemExit("<prefix>: <one line>") (exit status 1,
  the line on stderr, no traceback)."""
  try:
    yield
  except kinds as e:
    raise SystemExit(f"{prefix}: {one_line(e)}") from None
