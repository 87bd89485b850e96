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
# stop strings are matched in the detokenized text: a model without a tokenizer.json has none
STOP_NEEDS_TOKENIZER = "stop strings need the model's tokenizer.json; this model has none (use stop_token_ids)"
TOO_LARGE_HINT = ("; the router takes requests up to its --max-request-bytes, and prompts up to its "
                  "--max-prompt-bytes")

# A router that drains refuses new requests UNAVAILABLE with this in the message (router_service/engine/engine.py):
# a client may send them again on a new connection, which behind a load balancer reaches another router
DRAINING_MARK = "the router is shutting down (draining)"

# A request longer than the model's length says so in vLLM's and OpenAI's words, which client libraries
# (LiteLLM, LangChain) recognise for their context-window fallbacks; the HTTP front adds OpenAI's code for it.
CONTEXT_LENGTH_MARK = "This model's maximum context length is"


def context_length_exceeded(limit: int, prompt: int, completion: int | None) -> str:
    """The message for a prompt of `prompt` tokens (plus `completion` asked for, None: the prompt alone, 0: as many as
    fit, and none does) over `limit`."""
    if completion is None:
        return (f"{CONTEXT_LENGTH_MARK} {limit} tokens. However, the prompt is {prompt} tokens; send a shorter "
                f"prompt")
    if completion == 0:             # max_tokens 0 (as many as fit), and none fit
        return (f"{CONTEXT_LENGTH_MARK} {limit} tokens. However, the prompt is {prompt} tokens, which leaves no "
                f"room for a new token (max_tokens 0 or not given: as many as fit); send a shorter prompt")
    return (f"{CONTEXT_LENGTH_MARK} {limit} tokens. However, you requested {prompt + completion} tokens ({prompt} "
            f"in the prompt, {completion} for max_tokens); send a shorter prompt or a lower max_tokens")
