"""User-facing errors: each message says what is wrong and what to fix."""


class ColibriError(Exception):
    """A problem the user can fix (bad checkpoint, bad flag); printed without a traceback."""


class CheckpointError(ColibriError):
    """The checkpoint is missing, truncated or does not match its config."""


class ConfigError(ColibriError):
    """config.json names an unsupported architecture or holds values we cannot serve."""


# gRPC's own answer to a message over the receiver's limit says "larger than max (N vs. M)" and nothing of the
# flag that sets M; what prints it (the CLI, the HTTP front) adds this.
TOO_LARGE_MARK = "larger than max"
TOO_LARGE_HINT = ("; the router takes requests up to its --max-request-bytes, and prompts up to its "
                  "--max-prompt-bytes")
