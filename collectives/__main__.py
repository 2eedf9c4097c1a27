"""``python -m collectives bench|doctor|env``: the ``collectives`` command (collectives.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m collectives"))
