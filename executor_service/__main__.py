"""``python -m executor_service [args]`` = ``kvpager executor [args]``."""

import sys

from kvpager.cli import main

sys.exit(main(["executor", *sys.argv[1:]]))
