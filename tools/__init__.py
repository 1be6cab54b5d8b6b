"""Operator tools that talk to a running worker as clients: ``coliworker demo``, ``top``
and ``health``. Nothing here runs inside the worker.

    demo.py     a small GLM-style decode loop, every offloaded call checked against NumPy
    top.py      a terminal view of a worker's /metrics endpoint
    health.py   a grpc.health.v1 probe with no extra package (container HEALTHCHECK)
"""
