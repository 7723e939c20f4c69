"""`python -m qnext.server [MODEL] [flags]` is `qnext serve [MODEL] [flags]`; `python -m qnext.server pd-router
[flags]` is `qnext pd-router [flags]`."""
import sys

from qnext.server.cli import main

args = sys.argv[1:]
sys.exit(main(args if args[:1] == ["pd-router"] else ["serve", *args]))
