"""`python -m qnext.server [MODEL] [flags]` is `qnext serve [MODEL] [flags]`."""
import sys

from qnext.server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
