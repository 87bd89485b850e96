"""`colibri generate`: one request to a running router, the text streamed to stdout."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass

from colibri_common.errors import TOO_LARGE_HINT, TOO_LARGE_MARK
from colibri_common.flags import option
from colibri_common.options import ClientTls, check_target
from router_service.engine.sequence import Sampling


@dataclass(frozen=True)
class GenerateOptions:
    EXCLUDED = ("sampling.return_logits",)

    target: str = option("", "router address HOST:PORT", required=True)
    prompt: str | None = option(None, "prompt text (needs the model's tokenizer.json)")
    prompt_ids: tuple[int, ...] | None = option(None, "comma-separated prompt token ids", metavar="ID[,ID...]")
    json: bool = option(False, "print one JSON object on the last line instead of the streamed text")
    tls: ClientTls = ClientTls()
    sampling: Sampling = Sampling()

    def __post_init__(self) -> None:
        check_target("--target", self.target)
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3")
        if self.prompt_ids is not None and min(self.prompt_ids) < 0:
            raise ValueError(f"--prompt-ids: token ids are 0 or more, got {min(self.prompt_ids)}")
        if self.sampling.top_p == 0.0:          # the wire's "unset" (off), which no one typing 0 means
            raise ValueError("--top-p must be in (0, 1] (1 = off), got 0: for near-greedy sampling give a small "
                             "value, for greedy --temperature 0")


def run_generate(opts: GenerateOptions) -> int:
    import grpc

    from colibri.client import Client, make_request

    prompt: str | list[int] = opts.prompt if opts.prompt is not None else list(opts.prompt_ids or ())
    try:
        req = make_request(prompt, **dataclasses.asdict(opts.sampling))
    except ValueError as exc:               # a value no request can carry (past its field's range, not Unicode)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    client = Client(opts.target, opts.tls.tls_ca, opts.tls.tls_cert, opts.tls.tls_key)
    ids, text, reason, logprobs = [], "", "", []
    try:
        for msg in client.stream(req):
            kind = msg.WhichOneof("response")
            if kind == "chunk":
                ids.extend(msg.chunk.token_ids)
                text += msg.chunk.text
                logprobs += [_logprob(lp) for lp in msg.chunk.logprobs]
                if not opts.json:
                    print(msg.chunk.text, end="", flush=True)
            elif kind == "complete":
                reason = msg.complete.finish_reason
    except grpc.RpcError as exc:
        details = exc.details() or ""
        hint = TOO_LARGE_HINT if TOO_LARGE_MARK in details else opts.tls.hint(details)
        print(f"error: {exc.code().name}: {details}{hint}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if opts.json:
        print(json.dumps({"token_ids": ids, "text": text, "finish_reason": reason,
                          **({"logprobs": logprobs} if opts.sampling.wants_logprobs else {})}))
    else:
        print()
        if not text and ids:                     # no tokenizer.json: the text is empty, the tokens are not
            print(f"token ids: {ids}")
        for lp in logprobs:                      # --logprobs: one line a token, after the text
            top = "  ".join(f"{t['token_id']}:{t['logprob']:.4f}" for t in lp["top"])
            line = f"logprob {lp['token_id']:>7} {lp['token']!r:>12} {lp['logprob']:9.4f}"
            print(line + (f"   top {top}" if top else ""))
    return 0


def _logprob(lp) -> dict:
    return {"token_id": lp.token_id, "token": lp.token, "logprob": lp.logprob,
            "top": [{"token_id": t.token_id, "token": t.token, "logprob": t.logprob} for t in lp.top]}
