"""`python -m gateway` == `kvpager gateway`."""

import sys

from kvpager.cli import main

sys.exit(main(["gateway", *sys.argv[1:]]))
