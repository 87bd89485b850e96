"""What users run: the `colibri` CLI, the local launcher, the load generator, the Python client, the validator."""

__version__ = "0.1.0"
