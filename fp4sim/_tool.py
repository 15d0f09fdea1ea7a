"""The rule every fp4sim command line follows when printing and when interrupted (used by each command's
``__main__`` and by ``fp4sim COMMAND``)."""
from __future__ import annotations

import os
import sys

__all__ = ["say", "run_tool"]


def say(text: str = "") -> None:
    """Print a command's report to stdout as a Unix tool does: a reader that closes the pipe early (``| head``)
    ends the printing, not the command — its files are written and its exit status kept (every command prints
    its report through this, after writing its files)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _quiet_stdout()


def _quiet_stdout():
    """stdout to /dev/null, so that neither later prints nor the interpreter's final flush raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def run_tool(main, prog: str, argv=None) -> int:
    """``main(argv)`` under the one rule of every fp4sim command: Ctrl-C prints one line (``PROG: interrupted``)
    and exits 130, as a shell reports SIGINT; a pipe closed under a print that did not go through :func:`say`
    ends the command quietly with 141 (SIGPIPE's status) — no traceback either way."""
    import warnings
    shown = warnings.showwarning

    def one_line(message, category, filename, lineno, file=None, line=None):
        # a command's user reads what the warning says, not the library's source line it came from
        try:
            (file or sys.stderr).write(f"{prog}: warning: {' '.join(str(message).split())}\n")
        except OSError:
            pass
    warnings.showwarning = one_line
    try:
        rc = main(argv)
        sys.stdout.flush()
        return rc
    except KeyboardInterrupt:
        try:
            sys.stderr.write(f"\n{prog}: interrupted\n")
            sys.stderr.flush()
        except OSError:
            pass
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    finally:
        warnings.showwarning = shown
