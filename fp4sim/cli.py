"""``fp4sim COMMAND``: one command for the package's tools (``fp4sim --help`` lists them), each with the same parser
as its ``python -m`` form, which keeps working."""
from __future__ import annotations

import sys

from ._tool import run_tool

COMMANDS = {
    "analyze": "what NVFP4, MXFP4, FP8 and BF16 do to tensors (python -m fp4sim.analyze)",
    "validate": "check a kernel's quantized codes and scales against the emulator (python -m fp4sim.validate)",
    "inspect": "a Hugging Face model folder and a text file to a per-layer NVFP4 report (python -m fp4sim.inspect_model)",
    "recipes": "print the training presets' six operands as a Markdown table",
    "spec": "print the element formats as a Markdown table",
    "formats": "the format table and a test tensor rounded through every scheme (python -m fp4sim)",
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fp4sim COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:{width}}  {what}" for name, what in COMMANDS.items()]
    lines += ["", "fp4sim COMMAND --help shows a command's own options."]
    return "\n".join(lines)


def main(argv=None) -> int:
    return run_tool(_dispatch, "fp4sim", argv)


def _dispatch(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__
        print(f"fp4sim {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "analyze":
        from .analyze.__main__ import main as run
        return run(rest)
    if cmd == "validate":
        from .validate.__main__ import main as run
        return run(rest)
    if cmd == "inspect":
        from .inspect_model import main as run
        return run(rest)
    if cmd in ("recipes", "spec") and rest and rest[0] in ("-h", "--help"):     # their own page, not formats'
        print(f"usage: fp4sim {cmd}\n\n{COMMANDS[cmd][0].upper()}{COMMANDS[cmd][1:]} (the table of "
              f"{'docs/training.md' if cmd == 'recipes' else 'docs/formats.md'}); it takes no options.")
        return 0
    if cmd in ("recipes", "spec") and rest:
        print(f"fp4sim {cmd}: takes no arguments (got {' '.join(rest)})", file=sys.stderr)
        return 2
    if cmd in ("recipes", "spec", "formats"):
        from .__main__ import main as run
        return run({"recipes": ["--recipes"], "spec": ["--spec"], "formats": []}[cmd] + rest)
    print(f"fp4sim: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
