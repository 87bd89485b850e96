"""OpenAI request bodies -> the router's SamplingParams and prompts, checked field by field.

Each wrong field is a 400 that names it (`param`). Fields OpenAI defines that Colibri cannot honour (tools,
logit_bias, suffix, echo, best_of != n, non-text content parts) are refused, never ignored; unknown fields
are ignored, as OpenAI's own server does, so clients that send extras work. vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, add_special_tokens) are accepted
too; its others (beam search, bad_words, skip_special_tokens false, ...) are refused unless they hold vLLM's
default.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from colibri.client import wire_top_p
from colibri.openai_api.errors import ApiError, bad
from colibri_common.pb import generation_pb2 as pb

MAX_TOP_LOGPROBS = 20
MAX_N = 64
MAX_PROMPTS = 64            # prompts in one completions request (each is its own router call)
MAX_ID = 2**31 - 1          # token ids travel as int32
COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when the request leaves it out (OpenAI's and vLLM's)
RESERVED_TEMPLATE_KEYS = ("messages", "tools", "documents", "add_generation_prompt")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
NEED_CONTENT = ("system", "developer", "user")           # roles whose message is its content


@dataclass(frozen=True)
class Parsed:
    """One HTTP request's work: its prompts (text or ids) and the sampling every prompt shares."""

    prompts: list[str | list[int]]
    sampling: pb.SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    messages: list[dict[str, Any]] = field(default_factory=list)      # chat: rendered by the front
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True      # a text prompt's BOS (vLLM: completions yes, chat no: the template's own)
    omitted: frozenset[str] = frozenset()   # of DEFAULTED, the fields the request left out

    def with_defaults(self, defaults: dict[str, float]) -> Parsed:
        """The sampling with the checkpoint's recommended values (ModelInfo's) where the request left them out."""
        given = {k: v for k, v in defaults.items() if k in self.omitted}
        if not given:
            return self
        sp = pb.SamplingParams()
        sp.CopyFrom(self.sampling)
        for name, value in given.items():
            if name == "max_tokens":                  # chat's 0 (as many as fit, the router caps it at the
                if sp.max_tokens:                     # default there), completions' 16: at most it
                    sp.max_tokens = min(sp.max_tokens, int(value))
                else:
                    sp.default_max_tokens = int(value)
            else:
                setattr(sp, name, int(value) if name == "top_k" else value)
        if sp.top_k < 0:                                           # HF and vLLM: -1 = off, as 0 on the wire
            sp.top_k = 0
        return dataclasses.replace(self, sampling=sp)

    def check_min_tokens(self, completions_default: int) -> None:
        """min_tokens over a max_tokens the request left out says where that max_tokens came from (the router would
        name only the number)."""
        sp = self.sampling
        limit = sp.max_tokens or sp.default_max_tokens        # completions' (16 or less), chat's generation_config's
        if "max_tokens" in self.omitted and limit and sp.min_tokens > limit:
            source = "this model's generation_config.json (max_new_tokens)" if sp.default_max_tokens or \
                limit != completions_default else f"the default of {completions_default}"
            raise bad(f"'min_tokens' {sp.min_tokens} is over max_tokens, which the request left out: {limit} "
                      f"from {source}; send max_tokens of at least {sp.min_tokens}", "min_tokens")


# the sampling fields a checkpoint's generation_config.json may give defaults for (colibri_common.sampling_defaults)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def _omitted(body: dict[str, Any]) -> frozenset[str]:
    left = {name for name in DEFAULTED if body.get(name) is None}
    if body.get("max_completion_tokens") is not None:      # chat's newer name for it
        left.discard("max_tokens")
    return frozenset(left)


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:               # JSON true is not a number here
        raise bad(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise bad(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    try:
        value = float(_get(body, name, (int, float), default))
    except OverflowError:
        raise bad(f"'{name}' must be in [{lo:g}, {hi:g}]", name) from None
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be in [{lo:g}, {hi:g}], got {value:g}", name)
    return value


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int = 2**31 - 1) -> int | None:
    """An integer field; a float that holds a whole number (256.0, as clients that compute it send) is that number,
    as vLLM's pydantic takes it; 2.5 is a 400."""
    given = body.get(name)
    if isinstance(given, float) and math.isfinite(given) and given.is_integer() and abs(given) < 2**53:
        body = {name: int(given)}
    value = _get(body, name, (int,), default)
    if value is not None and not lo <= value <= hi:
        raise bad(f"'{name}' must be an integer in [{lo}, {hi}], got {value}", name)
    return value


# vLLM's structured-output and prompt extras: asked for, they change what comes back, so they are refused
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "guided_whitespace_pattern", "structured_outputs", "prompt_logprobs", "return_tokens_as_token_ids",
          "return_token_ids")
# ... of which these ask for something whatever their value: an empty schema {} is "any JSON", an empty regex or
# choice list constrains too, and prompt_logprobs 0 is the prompt tokens' own log-probabilities
ASKED_BY_ANY_VALUE = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "prompt_logprobs")


# vLLM's other extras this server does not do: refused unless they hold vLLM's default (clients send those)
VLLM_DEFAULTS: dict[str, Any] = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                                 "use_beam_search": False, "length_penalty": 1.0, "typical_p": 1.0,
                                 "allowed_token_ids": [], "bad_words": [], "logits_processors": [],
                                 "truncate_prompt_tokens": None, "prompt_embeds": None}


def _refuse(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in (*names, *GUIDED):
        value = body.get(name)
        if value is not None and (name in ASKED_BY_ANY_VALUE or value not in (False, [], {}, "")):
            raise bad(f"'{name}' is not supported by this server", name)
    for name, default in VLLM_DEFAULTS.items():
        value = body.get(name)
        if value is not None and (value != default or isinstance(value, bool) != isinstance(default, bool)):
            raise bad(f"'{name}' other than {json.dumps(default)} is not supported by this server", name)


def _text_format(body: dict[str, Any]) -> None:
    """`response_format` is text or nothing: JSON mode and schemas are structured output, which this server does
    not constrain (a 200 of free text would look like an answer in the asked format)."""
    fmt = _get(body, "response_format", (dict,), None)
    if fmt is not None and fmt.get("type") not in (None, "text"):
        raise bad("'response_format' other than {'type': 'text'} is not supported by this server",
                  "response_format")


def check_text(text: str, param: str) -> str:
    """Text that UTF-8 can carry (JSON may hold lone UTF-16 surrogates, which protobuf refuses)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(f"'{param}' holds a character UTF-8 cannot encode ({exc.reason}: a lone surrogate "
                  f"{text[exc.start:exc.end]!a})", param) from None
    return text


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    return [check_text(s, "stop") for s in stops]


def _sampling(body: dict[str, Any], max_tokens: int | None, logprobs: bool, top_logprobs: int) -> pb.SamplingParams:
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise bad("'best_of' other than n is not supported by this server", "best_of")
    top_k = _int(body, "top_k", 0, -1)
    sp = pb.SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_top_p(body),
        top_k=max(0, top_k or 0), min_p=_number(body, "min_p", 0.0, 0.0, 1.0), max_tokens=max_tokens or 0,
        min_tokens=_int(body, "min_tokens", 0, 0) or 0,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-6, 100.0),
        stop=_stop(body), ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)),
        logprobs=logprobs, top_logprobs=top_logprobs, n=n or 1)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(_is_id(t) for t in stop_ids):
        raise bad(f"'stop_token_ids' must be a list of token ids (integers in [0, {MAX_ID}])", "stop_token_ids")
    sp.stop_token_ids.extend(stop_ids)
    seed = _get(body, "seed", (int,), None)
    if seed is not None:
        if not -2**63 <= seed < 2**63:        # OpenAI's and vLLM's int64: wrapping a larger one met another seed
            raise bad(f"'seed' must be a 64-bit integer, in [-2**63, 2**63 - 1], got {seed}", "seed")
        sp.seed = seed % 2**64                # a negative one as its 64 bits: each int64 its own stream
    return sp


def _top_p(body: dict[str, Any]) -> float:
    top_p = _get(body, "top_p", (int, float), 1.0)
    if not 0.0 < top_p <= 1.0:   # 0 would read as "off" on the wire; OpenAI and vLLM want (0, 1]
        raise bad(f"'top_p' must be in (0, 1], got {top_p}; for the likeliest token only use temperature 0", "top_p")
    return wire_top_p(float(top_p))


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_ID


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    opts = _get(body, "stream_options", (dict,), None)
    if opts is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise bad(f"'stream_options.include_usage' must be a boolean, got {type(usage).__name__}",
                  "stream_options.include_usage")
    if opts.get("continuous_usage_stats") not in (None, False):    # vLLM's: a usage in every chunk
        raise bad("'stream_options.continuous_usage_stats' is not supported by this server: "
                  "'include_usage' sends the usage in a last chunk", "stream_options.continuous_usage_stats")
    return bool(usage)


def _model(body: dict[str, Any]) -> str | None:
    """The model the request names; None where it names none (absent, null or "", which vLLM also takes as the
    served model: some clients send "")."""
    model = _get(body, "model", (str,), None)
    return check_text(model, "model") if model else None   # it is echoed in the 404's JSON (UTF-8)


def parse_completion(body: Any) -> Parsed:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _refuse(body, ("suffix", "logit_bias", "echo", "include_stop_str_in_output"))
    _text_format(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_id(p) for p in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(_is_id(t) for t in p)
                                                     for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad(f"'prompt' must be a non-empty string, a list of strings, a list of token ids (integers in "
                  f"[0, {MAX_ID}]) or a list of such lists", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}", "prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise bad("'prompt' must not be empty", "prompt")
    for p in prompts:
        if isinstance(p, str):
            check_text(p, "prompt")
    logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    stream = bool(_get(body, "stream", (bool,), False))
    return Parsed(prompts, _sampling(body, _int(body, "max_tokens", COMPLETION_MAX_TOKENS, 1), logprobs is not None,
                                     logprobs or 0),
                  stream, _stream_options(body, stream), _model(body),
                  add_special_tokens=bool(_get(body, "add_special_tokens", (bool,), True)), omitted=_omitted(body))


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"{where} must be an object with a string 'role'", where)
        if m["role"] not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {m['role']!r}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):             # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported "
                              f"by this model", f"{where}.content")
                texts.append(part["text"])
            content = "\n".join(texts)               # as vLLM joins them
        elif content is not None and not isinstance(content, str):
            raise bad(f"{where}.content must be a string, a list of text parts or null", f"{where}.content")
        if content is None and m["role"] in NEED_CONTENT:   # null is for an assistant's tool call (as OpenAI's)
            raise bad(f"{where} ({m['role']}) needs a 'content'", f"{where}.content")
        if "name" in m and not isinstance(m["name"], str):
            raise bad(f"{where}.name must be a string, got {m['name']!r}", f"{where}.name")
        msg = {k: v for k, v in m.items() if k != "content"}
        msg["content"] = content if content is not None else ""
        out.append(msg)
    return out


def parse_chat(body: Any) -> Parsed:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _refuse(body, ("tools", "functions", "logit_bias", "echo", "include_stop_str_in_output",
                   "continue_final_message", "audio", "documents"))
    if body.get("chat_template") is not None:
        raise bad("'chat_template' (a template of the request's own) is not accepted: the checkpoint's chat template "
                  "renders every request (as vLLM without --trust-request-chat-template); leave it out, or send the "
                  "rendered prompt to /v1/completions", "chat_template")
    _text_format(body)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise bad(f"'{name}' is not supported by this server", name)
    if body.get("modalities") not in (None, ["text"]):
        raise bad("'modalities' other than ['text'] is not supported by this server", "modalities")
    logprobs = bool(_get(body, "logprobs", (bool,), False))
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    newer, older = _int(body, "max_completion_tokens", None, 1), _int(body, "max_tokens", None, 1)
    max_tokens = older if newer is None else newer            # max_tokens: the older name; None: as many as fit
    stream = bool(_get(body, "stream", (bool,), False))
    kwargs = _get(body, "chat_template_kwargs", (dict,), {})
    taken = [k for k in RESERVED_TEMPLATE_KEYS if k in kwargs]
    if taken:
        raise bad(f"'chat_template_kwargs' must not set {', '.join(taken)} (the request's own fields)",
                  "chat_template_kwargs")
    return Parsed([], _sampling(body, max_tokens, logprobs, top or 0), stream, _stream_options(body, stream),
                  _model(body), _messages(body), kwargs,
                  bool(_get(body, "add_generation_prompt", (bool,), True)),
                  bool(_get(body, "add_special_tokens", (bool,), False)), _omitted(body))


MAX_REQUEST_ID = 200        # "chatcmpl-" + it + the call's "-<12 hex>-<prompt>" fit the router's 256


def request_id_of(header: str | None, body: Any) -> str | None:
    """The client's id for its request: the X-Request-Id header, else vLLM's `request_id` field; None where it gives
    none. 1 to 200 visible ASCII characters (it goes into the response's id and the router's logs)."""
    given, param = (header, "X-Request-Id") if header else \
        ((body.get("request_id"), "request_id") if isinstance(body, dict) else (None, ""))
    if given is None:                        # an empty header is none (some proxies forward one)
        return None
    if not isinstance(given, str) or not 0 < len(given) <= MAX_REQUEST_ID or \
            not all("!" <= ch <= "~" for ch in given):
        raise bad(f"'{param}' must be 1 to {MAX_REQUEST_ID} visible ASCII characters (no spaces), got "
                  f"{str(given)[:40]!a}", param)
    return given


def check_model(parsed: Parsed, served: str) -> None:
    if parsed.model is not None and parsed.model != served:
        raise ApiError(404, f"the model '{parsed.model}' does not exist; this server serves '{served}'", "model",
                       "model_not_found")
