"""A small Python client of the Generation service (used by `colibri generate`, `colibri bench`, tests)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from colibri_common.pb import generation_pb2 as pb
from colibri_common.pb import generation_pb2_grpc
from colibri_common.serving import CHANNEL_OPTIONS
from colibri_common.tls import client_channel


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    logits: list[np.ndarray] = field(default_factory=list)
    ttft_ms: float = 0.0


def make_request(prompt: str | list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 return_logits: bool = False, request_id: str = "", **sampling) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, return_logits=return_logits,
                           **sampling)
    if seed is not None:
        sp.seed = seed
    if isinstance(prompt, str):
        return pb.GenerateRequest(request_id=request_id, text=prompt, sampling=sp)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=sp)


class Client:
    def __init__(self, target: str, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        """Plaintext, or TLS when `tls_ca` (the router's CA) is given; `tls_cert`/`tls_key` for a router that
        requires client certificates."""
        self.channel = client_channel(target, CHANNEL_OPTIONS, tls_ca, tls_cert, tls_key)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout)

    def generate(self, prompt: str | list[int], max_tokens: int, timeout: float | None = 300, **kw) -> Result:
        res = Result()
        for msg in self.stream(make_request(prompt, max_tokens, **kw), timeout=timeout):
            kind = msg.WhichOneof("response")
            if kind == "chunk":
                res.token_ids.extend(msg.chunk.token_ids)
                res.text += msg.chunk.text
                res.logits.extend(np.frombuffer(b, dtype="<f4") for b in msg.chunk.logits)
            elif kind == "complete":
                res.finish_reason = msg.complete.finish_reason
                res.ttft_ms = msg.complete.ttft_ms
        return res

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)

    def close(self) -> None:
        self.channel.close()
