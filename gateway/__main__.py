"""`python -m gateway`: run the gateway."""

import sys

from kvpager.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before grpc is imported

from gateway.cli import main  # noqa: E402

sys.exit(main())
