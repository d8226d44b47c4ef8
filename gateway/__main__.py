"""`python -m gateway`: run the gateway."""

import sys

from gateway.cli import main

sys.exit(main())
