"""`python -m memory_service`: run the memory service."""

import sys

from kvpager.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before grpc is imported

from memory_service.cli import main  # noqa: E402

sys.exit(main())
