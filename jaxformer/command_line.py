"""What every jaxformer command line shares: argument errors as one line, and help texts
that state their defaults."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def fail(prog: str, message: str) -> NoReturn:
    """Stops a command with one clear line on stderr (exit status 2), not a traceback."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


class DefaultsFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help once, only where X says something.

    A help text that already states its default keeps it alone; a default of None (the
    help says what happens without the flag) or of a switch (off) adds nothing.
    """

    def _get_help_string(self, action):
        help = action.help or ""
        unsaid = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default:" in help or unsaid or not action.option_strings:
            return help
        return f"{help} (default: %(default)s)".lstrip()


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (`prog: error: ...`), not a usage dump."""

    def __init__(self, prog: str, description: str):
        super().__init__(prog=prog, description=description, formatter_class=DefaultsFormatter)

    def error(self, message) -> NoReturn:
        fail(self.prog, message)
