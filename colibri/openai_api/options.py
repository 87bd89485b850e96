"""`colibri openai`'s options: one frozen dataclass, its flags built from it (torch-free, fast --help)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from colibri.openai_api.policy import API_KEY_ENV, check_key, host_entry, origin_entry
from colibri_common.flags import option, upper
from colibri_common.options import LOG_LEVELS, check_target


def secret_option(help: str, metavar: str) -> Any:
    """A flag like `option(None)` that stays out of the options' repr (a logged repr never shows it). None is
    "not given"; an empty value is refused, as `--api-key "$UNSET"` would otherwise start an open front."""
    meta = {"help": help, "flag": None, "choices": None, "metavar": metavar, "required": False, "type": None}
    return dataclasses.field(default=None, repr=False, metadata={"cli": meta})


def check_model_name(name: str | None) -> None:
    """--served-model-name: None is "not given" (the checkpoint directory's name); a blank one is refused, as
    `--served-model-name "$UNSET"` would otherwise fall back to the default without a word."""
    if name is not None and not name.strip():
        raise ValueError(f"--served-model-name {name!r} is blank (an unset variable?): give the name clients "
                         f"send as 'model', or leave the flag out for the checkpoint directory's name")
    if name is not None and name != name.strip():
        raise ValueError(f"--served-model-name {name!r} starts or ends with white space, which no client sends "
                         f"as 'model': give it without")


@dataclass(frozen=True)
class OpenAIOptions:
    target: str = option("", "the router's gRPC address HOST:PORT", required=True)
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0 in a container)")
    port: int = option(8000, "HTTP port; 0 picks a free one")
    served_model_name: str | None = option(None, "the model's name in /v1/models and in requests' 'model' "
                                                 "(default: the name of the checkpoint directory the router "
                                                 "serves, from its ModelInfo)")
    request_timeout: float = option(600.0, "seconds one request may take before it ends with 504")
    max_body_bytes: int = option(4 << 20, "largest request body (413 beyond it, before it is parsed)")
    max_header_bytes: int = option(64 << 10, "largest request head, its request line and headers together (431 "
                                             "beyond it, and the connection closed, before any of it is used)")
    request_read_timeout: float = option(30.0, "seconds a connection may send nothing before its first request or "
                                               "while a request is incomplete (408, and the connection closed)")
    grace_period: float = option(30.0, "on SIGTERM: seconds open requests get to finish")
    tls_ca: str | None = option(None, "PEM CA of the router's certificate: talk TLS to the router", metavar="PATH")
    tls_cert: str | None = option(None, "PEM client certificate, for a router with --tls-client-auth",
                                  metavar="PATH")
    tls_key: str | None = option(None, "PEM private key of --tls-cert", metavar="PATH")
    api_key: str | None = secret_option(f"require 'Authorization: Bearer KEY' on every route but /health (401 "
                                        f"otherwise, compared in constant time). Default: ${API_KEY_ENV}, none "
                                        f"when unset. Prefer the variable: a flag shows in ps", metavar="KEY")
    allowed_hosts: tuple[str, ...] = option((), "Host header names (ports ignored) this front answers; others get "
                                                "421, against DNS rebinding. '*' = any, '*.example.com' = its "
                                                "subdomains. Default: the --host address, localhost, 127.0.0.1 "
                                                "and [::1]; on 0.0.0.0 or :: also this machine's addresses and "
                                                "host name. A list replaces the default: name those you keep",
                                            metavar="HOST[,HOST...]")
    allowed_origins: tuple[str, ...] = option((), "web origins (https://app.example.com) whose pages may call "
                                                  "this front from a browser: they get CORS headers and their "
                                                  "preflights answered; '*' = any. Default none: no CORS headers "
                                                  "and every preflight refused (403)",
                                              metavar="ORIGIN[,ORIGIN...]")
    generation_config: str = option("auto", "auto: requests that leave temperature, top_p, top_k, min_p, "
                                            "repetition_penalty or max_tokens out take the checkpoint's "
                                            "generation_config.json values (its authors' recommendation, as "
                                            "vLLM's default; max_tokens from max_new_tokens); vllm: OpenAI's "
                                            "defaults (temperature 1, no top-k/top-p)",
                                    choices=("auto", "vllm"))
    stream_stall_timeout: float = option(30.0, "seconds a streamed response may wait on a client that reads "
                                               "nothing (its socket's buffers full) before the front drops the "
                                               "connection's response and cancels its request on the router; 0 = "
                                               "never", metavar="SECONDS")
    sse_keepalive: float = option(15.0, "a streamed response whose tokens have no text to send for this many "
                                        "seconds (a model without a tokenizer, a stop string's prefix held back) "
                                        "gets an SSE comment line, so proxies and clients with idle timeouts "
                                        "(nginx's proxy_read_timeout, 60 s) keep it; 0 = never",
                                  metavar="SECONDS")
    access_log: bool = option(False, "log every HTTP request")
    log_level: str = option("INFO", "log level", choices=LOG_LEVELS, type=upper)

    def __post_init__(self) -> None:
        check_target("--target", self.target)
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"--generation-config must be auto or vllm, got {self.generation_config!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"--max-header-bytes must be at least 1024 (a browser's or an SDK's ordinary headers "
                             f"take several hundred bytes), got {self.max_header_bytes}")
        if not self.stream_stall_timeout >= 0:
            raise ValueError(f"--stream-stall-timeout must be >= 0 (0 = never), got {self.stream_stall_timeout}")
        if not self.sse_keepalive >= 0:
            raise ValueError(f"--sse-keepalive must be >= 0 (0 = never), got {self.sse_keepalive}")
        for name in ("request_timeout", "request_read_timeout", "grace_period"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give --tls-cert and --tls-key together")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ValueError("--tls-cert needs --tls-ca (the router's CA)")
        if self.api_key is not None:
            if not self.api_key.strip():
                raise ValueError("--api-key is empty (an unset variable?): give the key, or leave the flag out "
                                 f"to take ${API_KEY_ENV} (no key when that is unset too)")
            check_key(self.api_key, "--api-key")
        check_model_name(self.served_model_name)
        for entry in self.allowed_hosts:
            host_entry(entry)
        for entry in self.allowed_origins:
            origin_entry(entry)
