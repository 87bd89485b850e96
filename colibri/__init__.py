"""What users run: the `colibri` CLI, the local launcher, the load generator, the Python client, the validator."""

import os

__version__ = "0.1.0"

# gRPC core's INFO lines are noise to an operator (a worker that forks a kernel probe while a health check is
# in flight gets "Other threads are currently calling into gRPC, skipping fork() handlers"); its errors
# stay. Set before any gRPC import; a GRPC_VERBOSITY the user set wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
