"""kvpager's tooling: everything that is not the product.

The product is the three services (``memory_service``, ``executor_service``,
``gateway``), the kernels and the shared plumbing (``kvpager``); none of them
imports this package. Here live the ``kvpager`` command (``cli``), the local
stack launcher (``stack``, ``kvpager up``), the demo and the demo checkpoint
builder, the client front-ends (``generate``, ``blocks``), the benchmarks
(``bench``), the fault drills (``drills``) and the helpers they and the tests
share (a Redis launcher, free ports, percentiles).
"""
