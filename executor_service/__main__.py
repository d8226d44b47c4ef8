"""`python -m executor_service`: run an executor."""

import sys

from kvpager.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before grpc is imported

from executor_service.cli import main  # noqa: E402

sys.exit(main())
