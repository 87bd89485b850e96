"""User-facing errors: each message says what is wrong and what to fix."""


class ColibriError(Exception):
    """A problem the user can fix (bad checkpoint, bad flag); printed without a traceback."""


class CheckpointError(ColibriError):
    """The checkpoint is missing, truncated or does not match its config."""


class ConfigError(ColibriError):
    """config.json names an unsupported architecture or holds values we cannot serve."""
