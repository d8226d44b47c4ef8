"""`python -m memory_service`: run the memory service."""

import sys

from memory_service.cli import main

sys.exit(main())
