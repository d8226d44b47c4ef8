"""`python -m executor_service`: run an executor."""

import sys

from executor_service.cli import main

sys.exit(main())
