"""What every lla binary does with an error it can name: one line on stderr, a non-zero exit.

  with cli.one_line_errors(SomeError, prefix="replay", workdir=WORKDIR):
    ...
  if __name__ == "__main__":
    cli.run(main)

An input or state error (a file that is missing, a value out of range, a directory in use,
a config variant that does not exist, a plugin that does not import) is the user's to fix,
so it is reported as one line naming the problem, never as a traceback; any other
exception is a bug and keeps its traceback. `one_line_errors` catches the kinds a binary
names and every input error class of lla (`INPUT_ERRORS`), and removes the --workdir it
was given if the binary created it and left it empty. `run` is absl's app.run with a flag
(and config file) error as one line too.
"""

from __future__ import annotations

import contextlib
import os
import sys

from absl import app, flags

# lla's input and state errors, by module: each is the user's to fix (a missing or damaged
# file, a value out of range, a run directory in use or made by something else). Looked up
# only among the modules already imported (a module never imported raised nothing), so
# that a light binary (verify) imports no model code for its error handling.
INPUT_ERRORS = {
    "lla.active.run": ("ActiveInputError",),
    "lla.attacks.budget": ("BudgetError",),
    "lla.attacks.registry": ("IncompatibleCaptureError", "PluginError"),
    "lla.capture.capture": ("CaptureInputError",),
    "lla.capture.store": ("CaptureError",),
    "lla.data.fetch": ("FetchError",),
    "lla.data.paths": ("DataNotFoundError",),
    "lla.defenses.base": ("DefenseError",),
    "lla.evidence.rundir": ("RunLockedError",),
    "lla.evidence.signing": ("SigningError",),
    "lla.model.checkpoint": ("CheckpointError",),
    "lla.model.families": ("UnsupportedField",),
    "lla.model.gguf_io": ("GGUFError",),
    "lla.model.hf_io": ("CheckpointError",),
    "lla.model.loading": ("ModelLoadError",),
    "lla.replay.driver": ("ReplayInputError",),
    "lla.replay.regenerate": ("RegenerationError",),
    "lla.study.bridge": ("BridgeError",),
    "lla.study.main_table": ("WorkdirMismatch", "DocumentCountError"),
    "lla.study.real_weights": ("RealWeightsError",),
    "lla.sweep.cells": ("SweepConfigError",),
    "lla.sweep.study": ("StudyError",),
    "lla.train.finetune": ("CheckpointMismatch",),
}


def input_errors() -> tuple[type[BaseException], ...]:
  """The classes of INPUT_ERRORS whose modules this process imported."""
  out = []
  for module, names in INPUT_ERRORS.items():
    loaded = sys.modules.get(module)
    out += [getattr(loaded, n) for n in names if loaded is not None and hasattr(loaded, n)]
  return tuple(out)


def one_line(error: BaseException) -> str:
  """The message of `error` as one line (a KeyError's key unquoted; several lines joined)."""
  text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
  lines = [line.strip() for line in str(text).splitlines() if line.strip()]
  return " ".join(lines) or type(error).__name__


@contextlib.contextmanager
def one_line_errors(*kinds: type[BaseException], prefix: str = "error",
                    workdir: str | None = None):
  """Turns an exception of `kinds` or of lla's input errors into SystemExit("<prefix>: <one
  line>") (exit status 1, the line on stderr, no traceback). `workdir`, if it did not exist
  when the body started and is empty when it refuses, is removed: a refusal leaves nothing
  behind."""
  existed = workdir is None or os.path.exists(workdir)
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    if not isinstance(e, kinds + input_errors()):
      raise
    if not existed:
      with contextlib.suppress(OSError):
        os.rmdir(workdir)
    raise SystemExit(f"{prefix}: {one_line(e)}") from None


def _flag_error_line(error: BaseException) -> str:
  """A flag error in one line. A config file that raised (an unknown variant) comes wrapped
  with its traceback in the message: its last line, the exception itself, says it."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
    return lines[-1]
  return " ".join(lines) or type(error).__name__


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise SystemExit(f"error: {_flag_error_line(e)}") from None


def run(main) -> None:
  """app.run(main), with a flag or config file error as one line and exit status 1."""
  app.run(main, flags_parser=_parse_flags)
