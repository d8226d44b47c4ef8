"""`python -m memory_service` == `kvpager memory`."""

import sys

from kvpager.cli import main

sys.exit(main(["memory", *sys.argv[1:]]))
