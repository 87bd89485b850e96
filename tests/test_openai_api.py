"""The OpenAI-compatible front through the official `openai` client, against a real fleet (router + worker +
front processes on loopback) and transformers' greedy tokens and logits."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from urllib.parse import urlparse

import grpc
import openai
import pytest
import torch
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from colibri.client import AsyncClient, Client, GenerationError
from colibri.openai_api.errors import FLEET_ADDRESS, ApiError
from colibri_common.chat_template import ChatTemplate, load_chat_template
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.fleet_token import new_token
from colibri_common.pb import generation_pb2, generation_pb2_grpc
from colibri_common.token_gate import with_token
from colibri_common.tokenizer import Tokenizer
from tests.chat_fixtures import chat_checkpoint
from tests.conftest import colibri_popen, fleet, free_port, metrics, metrics_port
from tests.test_moe_transport import FakeRpcError
from tests.test_replicas import port_of, workers_of

METRICS_PORT = metrics_port(1)
MAX_LEN = 96
EXPERT_METHODS = {"Describe", "Forward", "ForwardStream", "Assign"}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Say hi.  "}]
FLEET_TOKEN = new_token()              # the worker plane's credential, so a test may call a worker itself


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """(oracle, transformers tokenizer, router address, serve's process)."""
    path = tmp_path_factory.mktemp("chat") / "chatty"
    oracle, hf_tok = chat_checkpoint(path)
    extra = ["--openai-port", "0", "--max-model-len", str(MAX_LEN), "--metrics-port", str(METRICS_PORT)]
    with fleet(path, 1, extra, env={FLEET_ENV: FLEET_TOKEN}) as (addr, proc):
        yield oracle, hf_tok, addr, proc


@pytest.fixture(scope="module")
def served(serving):
    oracle, hf_tok, addr, proc = serving
    api = openai.OpenAI(base_url=proc.openai, api_key="unused", max_retries=0, timeout=60)
    yield oracle, hf_tok, addr, proc.openai, api


def greedy_text(oracle, tok: Tokenizer, ids: list[int], n: int) -> str:
    return tok.decode(oracle.greedy(ids, n))


def test_models_lists_the_checkpoint_by_its_directory_name(served):
    *_, api = served
    assert [m.id for m in api.models.list()] == ["chatty"]
    assert api.models.retrieve("chatty").id == "chatty"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("other")


def test_completion_text_equals_the_grpc_api_and_transformers(served):
    oracle, hf_tok, addr, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    prompt = "The sky is"
    ids = hf_tok(prompt)["input_ids"]                        # transformers' tokenizer(text): <s> first, as vLLM
    assert ids[0] == hf_tok.bos_token_id and ids[1:] == tok.encode(prompt)
    ref = greedy_text(oracle, tok, ids, 12)
    assert ref != greedy_text(oracle, tok, ids[1:], 12)      # so a prompt without its <s> would show
    grpc_text = Client(addr).generate(prompt, 12).text
    res = api.completions.create(model="chatty", prompt=prompt, max_tokens=12, temperature=0)
    assert res.choices[0].text == grpc_text == ref
    assert res.choices[0].finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ids), 12)
    bare = api.completions.create(model="chatty", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"add_special_tokens": False})      # vLLM's field: without the <s>
    assert (bare.choices[0].text, bare.usage.prompt_tokens) == (greedy_text(oracle, tok, ids[1:], 12), len(ids) - 1)
    assert Client(addr).generate(prompt, 12, add_special_tokens=False).text == bare.choices[0].text
    streamed = api.completions.create(model="chatty", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_lists_of_prompts(served):
    oracle, _, _, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    prompts = [[5, 6, 7, 8], [40, 41]]
    res = api.completions.create(model="chatty", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in res.choices] == [0, 1]
    assert [c.text for c in res.choices] == [greedy_text(oracle, tok, p, 6) for p in prompts]
    assert res.usage.prompt_tokens == 6 and res.usage.completion_tokens == 12


def test_chat_template_is_rendered_as_transformers_renders_it(served):
    oracle, hf_tok, *_ = served
    template, special = load_chat_template(oracle.path)
    ours = ChatTemplate(template, special).render(MESSAGES, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<s><|system|>You are terse.</s>") and ours.endswith("<|assistant|>")
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(Exception, match="system message must come first"):
        hf_tok.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="system message must come first"):
        ChatTemplate(template, special).render(bad)


def test_a_requests_template_variables_override_the_special_tokens_and_may_be_named_self():
    template = ChatTemplate("{{ bos_token }}|{{ flavour }}|{{ messages[0]['content'] }}|{{ add_generation_prompt }}",
                            {"bos_token": "<s>"})
    assert template.render(MESSAGES[1:], True) == "<s>||  Say hi.  |True"
    assert template.render(MESSAGES[1:], False, {"flavour": "F", "bos_token": "B"}) == "B|F|  Say hi.  |False"
    # 'self' (jinja's own name for the template, which a variable does not replace) is no error: it was a 500
    assert template.render(MESSAGES[1:], True, {"self": 1}) == "<s>||  Say hi.  |True"


def test_the_routers_refusals_are_about_the_field_their_message_names():
    """OpenAI's `param` from the router's INVALID_ARGUMENT messages (router_service/api/server.py's words)."""
    code = grpc.StatusCode.INVALID_ARGUMENT
    for details, param in [
        ("token ids [32000] are outside the vocabulary [0, 32000)", "prompt"),
        ("the text prompt has 2000000 bytes, over the router's --max-prompt-bytes 1048576", "prompt"),
        ("the prompt is empty; send text or at least one token id", "prompt"),
        ("17 stop strings, over the router's --max-stop-strings 16", "stop"),
        ("stop string 1 has 1025 characters; at most 1024", "stop"),
        ("stop strings need the model's tokenizer.json; this model has none (use stop_token_ids)", "stop"),
        ("40 stop_token_ids, over the router's --max-stop-token-ids 32", "stop_token_ids"),
        ("stop_token_ids [1000000] are outside the vocabulary [0, 258)", "stop_token_ids"),
        ("min_tokens must be in [0, max_tokens]", "min_tokens"),
        ("top_p must be in (0, 1], got 1.5", "top_p"),
        ("default_max_tokens must be >= 0 (0 = none), got -1", None),      # the front's own field, not the client's
        ("something else entirely", None),
    ]:
        assert ApiError.of_grpc(FakeRpcError(code, details), prompt_param="prompt").param == param, details


def test_chat_greedy_equals_transformers_on_the_templated_prompt(served):
    oracle, hf_tok, _, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    ids = hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    ref = greedy_text(oracle, tok, list(ids), 10)
    res = api.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=10, temperature=0)
    assert res.choices[0].message.content == ref and res.choices[0].message.role == "assistant"
    assert res.usage.prompt_tokens == len(ids)
    stream = api.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=10, temperature=0,
                                         stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == "length"
    # a template that refuses the messages is the client's 400, with the template's own words
    with pytest.raises(openai.BadRequestError, match="system message must come first"):
        api.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "a"},
                                                              {"role": "system", "content": "b"}])
    # what would change the answer's form is refused by name (these were answered 200 with plain text)
    for extra, param in [({"function_call": "auto"}, "function_call"), ({"modalities": ["audio"]}, "modalities"),
                         ({"audio": {"voice": "x"}}, "audio"), ({"guided_json": {"type": "object"}}, "guided_json")]:
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=2, extra_body=extra)
        assert err.value.body["param"] == param


def test_max_tokens_defaults_to_what_fits(served):
    *_, api = served
    res = api.chat.completions.create(model="chatty", messages=MESSAGES, temperature=0)
    assert res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens + res.usage.completion_tokens == MAX_LEN


def test_n_choices_share_prompt_blocks_and_greedy_choices_agree(served):
    oracle, _, _, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    prompt = "A long enough prompt to fill more than one KV block of sixteen tokens"
    before = metrics(METRICS_PORT)["colibri:kv_cache_blocks_shared_total"]
    res = api.completions.create(model="chatty", prompt=prompt, max_tokens=8, temperature=0, n=2)
    ref = greedy_text(oracle, tok, tok.encode(prompt, True), 8)
    assert [c.text for c in res.choices] == [ref, ref] and [c.index for c in res.choices] == [0, 1]
    assert res.usage.completion_tokens == 16
    shared = (len(tok.encode(prompt, True)) - 1) // 16
    assert shared >= 2
    assert metrics(METRICS_PORT)["colibri:kv_cache_blocks_shared_total"] - before == shared
    sampled = api.completions.create(model="chatty", prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=5)
    again = api.completions.create(model="chatty", prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=5)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]   # seeded: reproducible
    assert sampled.choices[0].text != sampled.choices[1].text                     # choice i has seed + i


def test_a_top_p_below_what_float32_holds_keeps_the_likeliest_token_not_every_token(served):
    """top_p travels as float32, where 1e-50 is 0, which the router reads as "off": it sampled the whole vocabulary.
    The front, and the gRPC client, send the smallest positive float32 instead: each of n sampled choices is the
    greedy text."""
    oracle, _, addr, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    prompt = "Sampling at a vanishing top_p"
    ref = greedy_text(oracle, tok, tok.encode(prompt, True), 6)
    for top_p in (1e-50, 5e-324, 1e-30):
        res = api.completions.create(model="chatty", prompt=prompt, max_tokens=6, temperature=1.0, n=4, top_p=top_p)
        assert [c.text for c in res.choices] == [ref] * 4, top_p
        got = Client(addr).generate(prompt, 6, temperature=1.0, n=4, top_p=top_p)
        assert [c.text for c in got.choices] == [ref] * 4, top_p


def test_chat_refuses_a_bad_max_tokens_beside_max_completion_tokens(served):
    """Both names given: the newer one is used, and the older one is still checked (it passed unread)."""
    *_, api = served
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model="chatty", messages=MESSAGES, max_completion_tokens=2, max_tokens=-5)
    assert err.value.body["param"] == "max_tokens"
    res = api.chat.completions.create(model="chatty", messages=MESSAGES, max_completion_tokens=2, max_tokens=50,
                                      temperature=0)
    assert res.usage.completion_tokens == 2


def test_stop_strings_end_the_text_before_the_match(served):
    oracle, _, addr, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    prompt = "Once upon a time"
    full = greedy_text(oracle, tok, tok.encode(prompt, True), 30)
    at = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full[i:i + 2] not in full[:i])
    stop = full[at:at + 2]
    for stream in (False, True):
        res = api.completions.create(model="chatty", prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "zzzz"],
                                     stream=stream)
        if stream:
            chunks = list(res)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = res.choices[0].text, res.choices[0].finish_reason
        assert (text, reason) == (full[:at], "stop")
    res = Client(addr).generate(prompt, 30, stop=[stop])
    assert (res.text, res.finish_reason, res.choices[0].stop_reason) == (full[:at], "stop", stop)
    ids = tok.encode(prompt, True)
    used = next(k for k in range(1, 31) if stop in tok.decode(oracle.greedy(ids, 30)[:k]))
    assert res.token_ids == oracle.greedy(ids, 30)[:used]      # up to the token that completed the match


def test_logprobs_match_the_oracles_log_softmax(served):
    oracle, hf_tok, _, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    prompt = "Numbers:"
    ids = tok.encode(prompt, True)
    res = api.completions.create(model="chatty", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    gen = oracle.greedy(ids, 6)
    ref = torch.log_softmax(oracle.step_logits(ids, gen).double(), dim=-1)        # [6, V]
    lp = res.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([float(ref[t, g]) for t, g in enumerate(gen)], abs=1e-4)
    for t, top in enumerate(lp.top_logprobs):   # {token text: logprob}: byte tokens that print alike merge
        best = ref[t].topk(3).values.tolist()
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(any(abs(v - b) < 1e-4 for b in best) for v in top.values())
    assert max(len(top) for top in lp.top_logprobs) == 3
    for n in (0, 1):                            # sampled: its token is in each dict too (N + 1 at most, as vLLM's)
        sampled = api.completions.create(model="chatty", prompt=prompt, max_tokens=6, temperature=1.5, seed=5,
                                         logprobs=n).choices[0].logprobs
        assert all(t in top and len(top) <= n + 1 for t, top in zip(sampled.tokens, sampled.top_logprobs,
                                                                      strict=True)), sampled
        assert all(top[t] == pytest.approx(v) for t, top, v in zip(sampled.tokens, sampled.top_logprobs,
                                                                    sampled.token_logprobs, strict=True)
                   if "\ufffd" not in t)            # byte tokens that print alike share the likeliest's value
    chat_ids = hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    chat = api.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    cgen = oracle.greedy(chat_ids, 4)
    cref = torch.log_softmax(oracle.step_logits(chat_ids, cgen).double(), dim=-1)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([float(cref[t, g]) for t, g in enumerate(cgen)], abs=1e-4)
    assert [len(c.top_logprobs) for c in content] == [2] * 4
    # `bytes` are each token's own (one byte a token here: its id), also half a character, which prints as U+FFFD
    # (its bytes were U+FFFD's); joined over the message they rebuild its text
    long = api.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=24, temperature=0,
                                       logprobs=True, top_logprobs=1)
    gen = oracle.greedy(chat_ids, 24)
    assert any(128 <= g < 256 for g in gen)                  # a byte that is no character alone
    own = [[g] if g < 256 else list(hf_tok.convert_ids_to_tokens(g).encode()) for g in gen]
    assert [c.bytes for c in long.choices[0].logprobs.content] == own
    joined = bytes(b for c in long.choices[0].logprobs.content for b in c.bytes)
    assert joined.decode("utf-8", "replace") == long.choices[0].message.content


def test_penalties_and_vllm_extras_reach_the_sampler(served):
    oracle, _, _, _, api = served
    tok = Tokenizer.from_dir(oracle.path)
    prompt = "aaaa"
    ids = tok.encode(prompt, True)
    ref: list[int] = []                     # the frequency penalty by hand on transformers' logits
    for _ in range(10):
        x = oracle.last_logits(ids + ref).double().clone()
        for t in set(ref):
            x[t] -= 1.5 * ref.count(t)
        ref.append(int(x.argmax()))
    res = api.completions.create(model="chatty", prompt=prompt, max_tokens=10, temperature=0, frequency_penalty=1.5)
    assert res.choices[0].text == tok.decode(ref)
    stop_id = oracle.greedy(ids, 10)[0]
    held = api.completions.create(model="chatty", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    cut = api.completions.create(model="chatty", prompt=prompt, max_tokens=10, temperature=0,
                                 extra_body={"stop_token_ids": [stop_id]})
    assert (cut.usage.completion_tokens, cut.choices[0].finish_reason) == (1, "stop")
    assert cut.choices[0].stop_reason == stop_id                  # an int, as vLLM's (it was the id's text)
    # the stop token's own text is left out, as vLLM leaves it (it was the whole text here)
    assert tok.decode([stop_id]) and cut.choices[0].text == ""
    later = oracle.greedy(ids, 10)[3]
    upto = oracle.greedy(ids, 10).index(later)
    for stream in (False, True):
        res = api.completions.create(model="chatty", prompt=prompt, max_tokens=10, temperature=0, stream=stream,
                                     extra_body={"stop_token_ids": [later]})
        text = "".join(c.choices[0].text for c in res) if stream else res.choices[0].text
        assert text == tok.decode(oracle.greedy(ids, 10)[:upto])


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"top_p": -1}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 2.5}, "max_tokens"),                    # 2.0 is 2, as vLLM's pydantic takes it; 2.5 is not
    ({"n": 1e300}, "n"),
    ({"max_tokens": 10_000}, "prompt"),                     # the router's own check: over the model's length
    ({"logprobs": 50}, "logprobs"),
    ({"extra_body": {"logit_bias": {"5": 1}}}, "logit_bias"),
    ({"extra_body": {"echo": True}}, "echo"),
    ({"stop": [""]}, "stop"),
    ({"top_p": 0}, "top_p"),                                 # 0 would read as "off" on the wire
    ({"temperature": 10**400}, "temperature"),               # a JSON integer no float holds
    ({"prompt": [1, 2**40]}, "prompt"),                      # token ids travel as int32
    ({"extra_body": {"stop_token_ids": [2**40]}}, "stop_token_ids"),
    ({"seed": 2**64 + 1}, "seed"),                           # int64, as OpenAI's: wrapped, it met seed 1's stream
    ({"seed": -2**63 - 1}, "seed"),
    ({"prompt": ["x"] * 65}, "prompt"),                      # at most 64 prompts per request
    # structured output and prompt extras change what comes back: refused, never ignored (they were, with a 200)
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"structured_outputs": {"regex": "a+"}}}, "structured_outputs"),
    ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),          # an empty schema is "any JSON": still asked
    ({"extra_body": {"prompt_logprobs": 0}}, "prompt_logprobs"),    # the prompt tokens' own: still asked
    ({"top_p": 1.5}, "top_p"),
    # vLLM's extras this server does not do: refused unless at vLLM's default (they were ignored, with a 200)
    ({"extra_body": {"skip_special_tokens": False}}, "skip_special_tokens"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"extra_body": {"bad_words": ["END"]}}, "bad_words"),
    ({"extra_body": {"allowed_token_ids": [5, 6]}}, "allowed_token_ids"),
    ({"extra_body": {"typical_p": 0.5}}, "typical_p"),
    ({"extra_body": {"truncate_prompt_tokens": 1}}, "truncate_prompt_tokens"),
    ({"extra_body": {"add_special_tokens": "yes"}}, "add_special_tokens"),
])
def test_bad_fields_are_400_naming_the_field(served, kwargs, param):
    *_, api = served
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model="chatty", **{"prompt": "x", "max_tokens": 4, **kwargs})
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error"
    if "max_tokens" in kwargs and kwargs["max_tokens"] == 10_000:   # as OpenAI's, which client libraries look for
        assert body["code"] == "context_length_exceeded"
        assert body["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens. However, you "
                                          f"requested 10002 tokens (2 in the prompt, 10000 for max_tokens)")
    assert api.completions.create(model="chatty", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_integer_fields_sent_as_whole_floats_are_those_integers(served):
    """max_tokens 3.0, n 2.0, logprobs 1.0 (JavaScript clients and computed values send them): vLLM's pydantic takes
    them as integers, and they had been 400s."""
    *_, url, _ = served
    status, got = raw(url, "POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 3.0, "n": 2.0,
                                                                  "logprobs": 1.0, "ignore_eos": True}).encode())
    assert status == 200 and got["usage"]["completion_tokens"] == 6 and len(got["choices"]) == 2, got
    assert all(len(c["logprobs"]["tokens"]) == 3 for c in got["choices"]), got


def test_vllm_extras_at_their_defaults_are_accepted(served):
    *_, api = served
    defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "use_beam_search": False,
                "typical_p": 1.0, "bad_words": [], "allowed_token_ids": [], "truncate_prompt_tokens": None}
    plain = api.completions.create(model="chatty", prompt="x", max_tokens=4, temperature=0)
    res = api.completions.create(model="chatty", prompt="x", max_tokens=4, temperature=0, extra_body=defaults)
    assert res.choices[0].text == plain.choices[0].text


def raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, json.loads(data) if data else {}


def test_unknown_model_is_404_and_bad_bodies_are_400_in_openais_shape(served):
    *_, url, api = served
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4", messages=MESSAGES)
    for body, needle in ((b"{not json", "not valid JSON"), (b"[" * 100_000, "nests arrays or objects too deep"),
                         (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
                         (b"[1, 2]", "JSON object"),
                         (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "lone surrogate"),   # UTF-8 cannot carry
                         (b'{"model": "\\ud800", "prompt": "x"}', "'model' holds a character"),   # was a 500
                         # bytes json.loads took for UTF-16 ("Expecting value"): the body is not UTF-8
                         (b'\xff\xfe{"prompt": "x"}', "not UTF-8, which JSON on the wire must be: invalid start "
                                                         "byte at byte 0")):
        status, err = raw(url, "POST", "/v1/completions", body)
        assert status == 400 and needle in err["error"]["message"], (status, err)
        assert "sys." not in err["error"]["message"] and "recursion" not in err["error"]["message"]  # not Python's
    status, ok = raw(url, "POST", "/v1/completions", b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}')   # UTF-8's BOM
    assert status == 200 and ok["usage"]["completion_tokens"] == 1, ok
    status, err = raw(url, "POST", "/v1/completions", json.dumps({"prompt": "x", "stream": True, "stream_options": {
        "include_usage": "yes"}}).encode())
    assert (status, err["error"]["param"]) == (400, "stream_options.include_usage"), err     # the field's whole path
    # min_tokens over a max_tokens the request left out: where that max_tokens came from (completions' 16)
    status, err = raw(url, "POST", "/v1/completions", json.dumps({"prompt": "x", "min_tokens": 20}).encode())
    assert (status, err["error"]["param"]) == (400, "min_tokens"), err
    assert "left out: 16 from the default of 16; send max_tokens of at least 20" in err["error"]["message"], err
    # more sequences than the router ever queues (8 prompts x n=64 > its 256): 429 'retry later' on an idle server
    status, err = raw(url, "POST", "/v1/completions",
                      json.dumps({"prompt": [[1, 2]] * 8, "n": 64, "max_tokens": 1}).encode())
    assert status == 400 and err["error"]["param"] == "n" and "--max-waiting" in err["error"]["message"], err
    status, err = raw(url, "POST", "/v1/chat/completions", b'{"model": "\\ud800", "messages": []}')
    assert status == 400 and err["error"]["param"] == "model", (status, err)
    status, err = raw(url, "POST", "/v1/completions", json.dumps({"prompt": "x" * (5 << 20)}).encode())
    assert status == 413 and "--max-body-bytes" in err["error"]["message"]
    for kw, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                      ({"messages": [{"role": "banana", "content": "x"}]}, "messages[0].role"),
                      ({"messages": [{"role": "user"}]}, "messages[0].content"),             # were accepted
                      ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
                      ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name")):
        status, err = raw(url, "POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, **kw}).encode())
        assert (status, err["error"]["param"]) == (400, param), err
    # the router's refusals name the field (OpenAI's `param`), and which of several prompts it refused
    for body, param, needle in (
            ({"prompt": [[1, 2, 3], [4, 5, 6], [10**6]]}, "prompt", "token ids [1000000]"),
            ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids", "stop_token_ids [1000000] are outside"),
            ({"prompt": "x", "min_tokens": 10**6}, "min_tokens", "min_tokens")):
        status, err = raw(url, "POST", "/v1/completions", json.dumps({"max_tokens": 2, **body}).encode())
        assert (status, err["error"]["param"]) == (400, param) and err["error"]["message"].startswith(needle), err
        assert ("(prompt 2 of 3, from 0)" in err["error"]["message"]) == (len(body["prompt"]) == 3), err
    long = json.dumps({"prompt": [[1], [1] * 20000], "max_tokens": 2}).encode()
    status, err = raw(url, "POST", "/v1/completions", long)
    assert (status, err["error"]["param"], err["error"]["code"]) == (400, "prompt", "context_length_exceeded"), err
    assert err["error"]["message"].startswith("This model's maximum context length is"), err    # OpenAI's opening
    assert err["error"]["message"].endswith("(prompt 1 of 2, from 0)"), err
    # a template variable named as one of render's own parameters ('self' was a 500): just a variable
    plain = api.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=3, temperature=0)
    for kw in ({"self": 1},):
        got = api.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=3, temperature=0,
                                          extra_body={"chat_template_kwargs": kw})
        assert got.choices[0].message.content == plain.choices[0].message.content
    status, err = raw(url, "GET", "/v1/embeddings")
    assert status == 404 and "/v1/chat/completions" in err["error"]["message"]
    status, err = raw(url, "GET", "/v1/completions")
    assert status == 405 and "GET is not allowed" in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"            # a client's mistake (was server_error)
    conn = http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=30)
    conn.request("GET", "/metrics")
    counted = conn.getresponse().read().decode()
    assert 'colibri_openai:refused_total{status="405"}' in counted      # counted as the other refusals (it was not)


def test_a_large_body_is_parsed_and_templated_off_the_event_loop_with_the_same_answers(served):
    """Bodies over OFF_LOOP_BYTES go through a worker thread (http_io.off_loop_if): the same answers and refusals."""
    *_, url, api = served
    from colibri.openai_api.http_io import OFF_LOOP_BYTES

    pad = "y" * OFF_LOOP_BYTES                                       # an unknown field: ignored, but parsed
    plain = api.completions.create(model="chatty", prompt="Hi", max_tokens=3, temperature=0)
    status, got = raw(url, "POST", "/v1/completions", json.dumps({"model": "chatty", "prompt": "Hi", "max_tokens": 3,
                                                                  "temperature": 0, "pad": pad}).encode())
    assert status == 200 and got["choices"][0]["text"] == plain.choices[0].text, got
    chat = [{"role": "user", "content": "z" * 64}] * (OFF_LOOP_BYTES // 64)     # templated on the thread too
    status, err = raw(url, "POST", "/v1/chat/completions", json.dumps({"model": "chatty", "messages": chat}).encode())
    assert status == 400 and err["error"]["param"] == "messages", err
    status, err = raw(url, "POST", "/v1/completions", b'{"prompt": "x", "pad": "' + pad.encode() + b'"')
    assert status == 400 and "not valid JSON" in err["error"]["message"], err


def test_health_and_metrics(served):
    *_, url, api = served
    api.completions.create(model="chatty", prompt="Hi", max_tokens=2)   # counted here (worksteal runs tests apart)
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert 'colibri_openai:requests_total{endpoint="completions",outcome="ok"}' in text
    assert "process_resident_memory_bytes" in text and "process_start_time_seconds" in text
    with pytest.raises(openai.BadRequestError):                         # the router's refusal: counted by status
        api.completions.create(model="chatty", prompt="Hi", max_tokens=10_000)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    assert 'colibri_openai:requests_total{endpoint="completions",outcome="400"}' in conn.getresponse().read().decode()


def kv_free() -> float:
    return metrics(METRICS_PORT)["colibri:kv_cache_blocks_free"]


def wait_kv(total: float, within: float) -> float:
    t0 = time.monotonic()
    while kv_free() != total:
        assert time.monotonic() - t0 < within, f"KV not freed within {within}s: {kv_free()} of {total} free"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_kv_within_a_second(served, stream):
    *_, url, _ = served
    total = metrics(METRICS_PORT)["colibri:kv_cache_blocks_total"]
    assert kv_free() == total
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    # 80 tokens (a short prompt, under MAX_LEN): still decoding when the first chunk is read, on a loaded machine too
    body = {"model": "chatty", "prompt": "x" * 4, "max_tokens": 80, "temperature": 0, "stream": stream,
            "extra_body": None, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")               # the stream is flowing
    else:
        t0 = time.monotonic()
        while kv_free() == total:                                  # the request is running on the router
            assert time.monotonic() - t0 < 30
            time.sleep(0.005)
    assert kv_free() < total
    conn.sock.shutdown(2)
    conn.close()
    wait_kv(total, within=1.0)
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert "colibri_openai:requests_in_flight 0.0" in text          # counted out, as an abort
    assert 'outcome="abort"' in text


@contextmanager
def front(target: str, *extra: str):
    """`colibri openai` alone (no model, no torch) in front of `target`; yields (host, port, client)."""
    p = colibri_popen(["openai", "--target", target, "--port", "0", "--log-level", "WARNING", *extra],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = p.stdout.readline()
        assert line.startswith("ready "), p.stderr.read()
        host, port = line.split()[1].rsplit(":", 1)
        yield host, int(port), openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0,
                                             timeout=30)
    finally:
        p.terminate()
        assert p.wait(timeout=30) == 0                 # SIGTERM: a clean stop, exit 0


def test_a_stream_without_text_to_send_gets_keepalive_comments(oracles):
    """A model without a tokenizer streams tokens with no text: the front sent nothing between the headers and the
    end, so an idle timeout on the way (nginx's 60 s) cut a healthy long stream. Now an SSE comment goes every
    --sse-keepalive seconds, which OpenAI's client skips."""
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 1) as (addr, _), front(addr, "--sse-keepalive", "0.05") as (host, port, api):
        body = {"model": oracle.path.name, "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        res = conn.getresponse()
        assert res.status == 200
        lines = [ln for ln in res.read().decode().split("\n") if ln]
        assert lines.count(": keep-alive") >= 2, lines[:8]
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and data[-1]["choices"][0]["finish_reason"] == "length", lines[-3:]
        sdk = {k: v for k, v in body.items() if k != "ignore_eos"}
        got = list(api.completions.create(**sdk, extra_body={"ignore_eos": True}))      # the SDK skips them
        assert got and got[-1].choices[0].finish_reason == "length"
        got = list(api.completions.create(**sdk, extra_body={"ignore_eos": True}, logprobs=0))   # ids as text
        ids = [int(t.split(":")[1]) for c in got if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert ids == oracle.greedy([1, 2, 3], 200)


def test_a_stream_whose_client_reads_nothing_is_dropped_after_the_stall_timeout(oracles):
    """A client that stops reading fills its socket's buffers and the front's write waits: the router's stall
    watch cancelled the request, but the front's handler waited on that write for as long as the client kept its
    connection (in flight for good on /metrics). The front's own --stream-stall-timeout now ends it."""
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 1, ["--stream-stall-timeout", "120"]) as (addr, _), \
            front(addr, "--stream-stall-timeout", "1") as (host, port, api):
        body = json.dumps({"model": oracle.path.name, "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True,
                           "stream": True, "logprobs": 20}).encode()
        with socket.socket() as stuck:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect((host, port))
            stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                          b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            t0 = time.monotonic()

            def in_flight() -> float:
                return metrics(port)["colibri_openai:requests_in_flight"]

            while in_flight() < 1 and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            while in_flight() > 0:                             # never read, never closed: dropped all the same
                assert time.monotonic() - t0 < 30, "the front still holds the stream of a client that reads nothing"
                time.sleep(0.1)
            got = api.completions.create(model=oracle.path.name, prompt=[1, 2, 3], max_tokens=8, temperature=0,
                                         logprobs=0)          # the front and the router serve on
            assert [int(t.split(":")[1]) for t in got.choices[0].logprobs.tokens] == oracle.greedy([1, 2, 3], 8)


def test_a_front_without_a_router_answers_503_and_says_not_ready():
    target = f"127.0.0.1:{free_port()}"
    with front(target) as (host, port, api):
        with pytest.raises(openai.InternalServerError) as err:
            api.completions.create(model="m", prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        assert "not ready" in err.value.body["message"]
        assert target.rsplit(":")[1] not in err.value.body["message"]      # the fleet's addresses stay inside
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503


def test_a_front_pointed_at_an_expert_worker_answers_502_saying_so(oracles):
    """It answered 401 authentication_error (the worker's fleet-token refusal) for its own misconfiguration."""
    worker = colibri_popen(["expert", "--model", str(oracles["qwen3_moe"].path), "--shard", "0/2", "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = worker.stdout.readline()
        assert line.startswith("ready "), line
        with front(line.split()[1]) as (_, _, api):
            with pytest.raises(openai.APIStatusError) as err:
                api.completions.create(model="m", prompt="x", max_tokens=2)
        assert err.value.status_code == 502
        assert "this port serves colibri.v1.ExpertWorker (an expert worker" in err.value.body["message"]
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_a_request_past_the_fronts_deadline_is_504_and_frees_its_kv(served):
    _, _, addr, *_ = served
    total = metrics(METRICS_PORT)["colibri:kv_cache_blocks_total"]
    # 90 tokens take ~0.1 s on the 2-core VMs since the fleet's layers went native: a deadline well under that
    with front(addr, "--request-timeout", "0.02") as (_, _, api):
        with pytest.raises(openai.InternalServerError) as err:
            api.completions.create(model="chatty", prompt="x", max_tokens=90, extra_body={"ignore_eos": True})
        assert err.value.status_code == 504 and "--request-timeout" in err.value.body["message"]
    wait_kv(total, within=1.0)


def test_grpc_statuses_map_to_the_codes_openai_clients_retry_on():
    codes = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
    got = {c: ApiError.of_grpc(FakeRpcError(c)) for c in codes}
    assert {c.name: e.status for c, e in got.items()} == {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429,
                                                          "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
                                                          "INTERNAL": 500}
    assert got[grpc.StatusCode.RESOURCE_EXHAUSTED].headers() == {"Retry-After": "1"}
    assert got[grpc.StatusCode.INVALID_ARGUMENT].headers() == {}
    assert got[grpc.StatusCode.INTERNAL].body()["error"]["type"] == "server_error"


@pytest.mark.parametrize(("details", "kept"), [
    ("expert worker 127.0.0.1:54649 failed on layer 3: UNAVAILABLE: gone", "failed on layer 3: UNAVAILABLE: gone"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.7:1: Connection refused",
     "Connection refused"),
    ("expert worker w-1.colibri.ns.svc:50052 is unreachable on /run/colibri/worker-1: refused", "is unreachable on"),
    ("expert worker worker0:50052: its stream was reset", "its stream was reset"),
    ("no live worker (down: router-a:1, expert-0:50052); UNKNOWN: ipv6:%5B::1%5D:1: x; unix:/tmp/s/w: y; "
     "[fd00::7]:50052, /tmp/colibri-fleet-x1/worker-1.sock", "no live worker"),
    ("the router at my-router:50051 said: failed", "said: failed"),
])
def test_error_messages_reach_http_clients_without_the_fleets_addresses(details, kept):
    """api.md: a client learns no address of the fleet; a worker's failure and gRPC's connection errors named
    the workers' and the router's host:port and the same-host socket paths. The front's own --target is hidden
    literally (a short host name is any word)."""
    message = ApiError.of_grpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, details), ("my-router:50051",)).message
    assert kept in message and FLEET_ADDRESS in message
    for leak in ("127.0.0.1", "10.0.0.7", "54649", "svc", "colibri/worker", ".sock", "fd00", "%5B", "worker0",
                 "router-a", "expert-0", "/tmp/s", "my-router"):
        assert leak not in message, message


def test_bracketed_numbers_are_not_taken_for_ipv6_addresses():
    """Token ids and ranges in brackets are the client's own values: only a bracketed text with a colon is an
    IPv6 address (they read "token ids <fleet address> are outside the vocabulary")."""
    for details in ("token ids [99999] are outside the vocabulary [0, 466)", "stop_token_ids [5000, 7]: bad",
                    "at [1.5]"):
        assert ApiError.of_grpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, details)).message == details
    for fine in ("layer 3: x", "a 3:4 ratio", "top-k:8", "prompt of 4097 tokens exceeds 4096", "e5m2:12",
                 "2024-01-01T12:30:00Z", "see https://example.com:8443/x", "model gpt-4.1:20"):
        assert ApiError.of_grpc(FakeRpcError(grpc.StatusCode.INTERNAL, fine)).message == fine


def test_reflection_lists_both_services_and_their_methods(serving):
    *_, addr, proc = serving
    workers = [port_of(w) for w in workers_of(proc)]          # ModelInfo names no worker
    for target, service, methods in ((addr, "colibri.v1.Generation", {"Generate", "Abort", "ModelInfo"}),
                                     (addr, "colibri.v1.Admin", {"ShowWorkers", "SetWorkers", "Rebalance"}),
                                     (workers[0], "colibri.v1.ExpertWorker", EXPERT_METHODS)):
        with grpc.insecure_channel(target) as channel:
            db = ProtoReflectionDescriptorDatabase(with_token(channel, FLEET_TOKEN))
            assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
                db.get_services())
            found = {m.name for m in DescriptorPool(db).FindServiceByName(service).methods}
            assert found == methods


# ------------------------------------------------------------------------------- the Python client (gRPC)


def test_async_client_equals_the_blocking_one_and_collects_every_choice(served):
    oracle, _, addr, _, _ = served
    tok = Tokenizer.from_dir(oracle.path)

    async def run():
        async with AsyncClient(addr) as aio:
            whole = await aio.generate("Hello", 8, n=2)
            pieces = [d async for d in aio.stream_text("Hello", 8)]
            with pytest.raises(ValueError, match="timeout must be seconds > 0"):
                await aio.generate("Hello", 8, timeout=-5)
        with pytest.raises(ValueError, match="this Client is closed"):
            await aio.generate("Hello", 8)
        return whole, pieces

    whole, pieces = asyncio.run(run())
    ref = greedy_text(oracle, tok, tok.encode("Hello", True), 8)
    with Client(addr) as client:
        assert client.generate("Hello", 8).text == ref
        assert "".join(d.text for d in client.stream_text("Hello", 8)) == ref
    assert [c.text for c in whole.choices] == [ref, ref] and whole.completion_tokens == 16
    assert "".join(d.text for d in pieces) == ref and pieces[-1].finish_reason == "length"


def test_client_deadline_abort_and_leaving_a_stream_early(served):
    *_, addr, _, _ = served
    total = metrics(METRICS_PORT)["colibri:kv_cache_blocks_total"]
    with Client(addr) as client:
        with pytest.raises(GenerationError) as err:
            client.generate("x", 80, timeout=0.02, ignore_eos=True)        # (80 tokens: ~0.1 s)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not err.value.retryable
        wait_kv(total, within=5.0)
        stream = client.stream_text("x", 80, ignore_eos=True)
        next(stream)
        stream.close()                                    # leaving the loop early cancels the request
        wait_kv(total, within=1.0)
        other = Client(addr)
        deltas = other.stream_text("x", 80, ignore_eos=True, request_id="to-abort")
        assert next(deltas).index == 0
        assert client.abort("to-abort") and not client.abort("no-such-request")
        assert [d.finish_reason for d in deltas][-1] == "abort"
        other.close()
        with pytest.raises(GenerationError) as err:
            client.generate([5], 4, temperature=-1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    with pytest.raises(ValueError, match="this Client is closed"):
        client.generate("x", 2)                           # the context manager closed the channel


def test_text_offsets_are_the_tokens_running_length_when_text_is_held_back():
    """A token whose text the router holds back (half a character, a stop string's start) gave the next tokens
    the same offset: [0, 1, 1] where vLLM's are [0, 1, 2]."""
    from colibri.openai_api.responses import Reply
    from colibri_common.pb import generation_pb2 as pb

    reply = Reply(False, "m", 1, True, True)
    lp = [pb.TokenLogprob(token_id=i, token=t, logprob=-1.0) for i, t in enumerate(["0", "\ufffd", "\x13"])]
    reply.add(0, pb.GenerateResponse(chunk=pb.Chunk(text="0", logprobs=lp[:2])))          # the second held back
    reply.add(0, pb.GenerateResponse(chunk=pb.Chunk(text="\ufffd\x13", logprobs=lp[2:])))
    reply.add(0, pb.GenerateResponse(complete=pb.Complete(finish_reason="stop", stop_reason="7")))
    choice = reply.body()["choices"][0]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert choice["stop_reason"] == 7
    named = Reply(False, "m", 1, True, False, stop_strings=("7",))                      # a stop string "7"
    named.add(0, pb.GenerateResponse(complete=pb.Complete(finish_reason="stop", stop_reason="7")))
    assert named.body()["choices"][0]["stop_reason"] == "7"


class SilentRouter(generation_pb2_grpc.GenerationServicer):
    """A router that knows its model but never answers a Generate (as one queuing a request behind a full batch)."""

    def __init__(self) -> None:
        self.started, self.cancelled = threading.Event(), threading.Event()

    def ModelInfo(self, request, context):  # noqa: N802 (gRPC's name)
        return generation_pb2.ModelInfoResponse(model_path="m", vocab_size=256, max_model_len=64,
                                                has_tokenizer=False, max_waiting=8)

    def Generate(self, request, context):  # noqa: N802
        self.started.set()
        while context.is_active():
            time.sleep(0.01)
        self.cancelled.set()
        return iter(())


def front_metrics(host: str, port: int) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def test_a_client_that_leaves_before_its_first_token_is_one_info_line(tmp_path):
    """The front cancels the router's call; it logged an ERROR and a 14-line traceback ('_GatheringFuture exception
    was never retrieved') for every such client. Its metrics count the request in flight while the router holds
    it, and as an abort after (it was in neither)."""
    router = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    stub = SilentRouter()
    generation_pb2_grpc.add_GenerationServicer_to_server(stub, router)
    rport = router.add_insecure_port("127.0.0.1:0")
    router.start()
    p = colibri_popen(["openai", "--target", f"127.0.0.1:{rport}", "--port", "0", "--log-level", "INFO"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = p.stdout.readline()
        assert line.startswith("ready "), p.stderr.read()
        host, port = line.split()[1].rsplit(":", 1)
        for _ in range(3):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            assert stub.started.wait(30), "the front did not call the router"   # which holds it: no first token
            assert "colibri_openai:requests_in_flight 1.0" in front_metrics(host, int(port))
            conn.sock.shutdown(2)
            conn.close()
            assert stub.cancelled.wait(10), "the front did not cancel the router's call"
            stub.started.clear()
            stub.cancelled.clear()
        time.sleep(0.5)
        text = front_metrics(host, int(port))
        assert 'colibri_openai:requests_total{endpoint="completions",outcome="abort"} 3.0' in text, text
        assert "colibri_openai:requests_in_flight 0.0" in text
    finally:
        p.terminate()
        p.wait(timeout=30)
        router.stop(0)
    err = p.stderr.read()
    assert err.count("the client went away before the first token") == 3, err
    assert "never retrieved" not in err and "Traceback" not in err, err


def test_an_http_client_that_stops_reading_is_cancelled_by_the_stall_timeout(tmp_path):
    """A stream is held to its client's pace end to end (the front's send buffer, HTTP/2's window to the router,
    the engine's pause), so a client that stops reading is cancelled after --stream-stall-timeout and its KV
    freed. The front's socket grew to megabytes and gRPC's window with it, and such a request generated on to
    its end into the buffers."""
    oracle, _ = chat_checkpoint(tmp_path / "chatty")
    mport = metrics_port(1)
    extra = ["--openai-port", "0", "--max-model-len", "512", "--stream-stall-timeout", "2", "--metrics-port",
             str(mport)]
    with fleet(oracle.path, 1, extra) as (_, proc):
        u = urlparse(proc.openai)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)            # a client that reads nothing
        sock.connect((u.hostname, u.port))
        body = json.dumps({"model": "chatty", "messages": MESSAGES, "max_tokens": 450, "ignore_eos": True,
                           "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 20})
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        done = 'colibri:request_success_total{finished_reason="%s"}'
        t0 = time.monotonic()
        while not metrics(mport)[done % "abort"]:
            assert not metrics(mport)[done % "length"], "the request ran to its end into the buffers"
            assert time.monotonic() - t0 < 60, "the stalled request was not cancelled"
            time.sleep(0.1)
        m = metrics(mport)
        assert m["colibri:kv_cache_blocks_free"] == m["colibri:kv_cache_blocks_total"]
        assert m["colibri:generation_tokens_total"] < 450
        sock.close()


def test_logprobs_are_the_models_own_whatever_the_sampling(served):
    """As vLLM's default (raw_logprobs): the oracle's log-softmax at each sampled token, at a temperature, with
    penalties; they had been taken over the temperature and after the penalties."""
    oracle, _, addr, _, _ = served
    prompt = [3, 17, 42, 9]
    with Client(addr) as client:
        for sampling in ({"temperature": 0.7, "seed": 4}, {"temperature": 1e-4, "seed": 4},
                         {"temperature": 1.3, "seed": 9, "repetition_penalty": 1.5, "presence_penalty": 1.0}):
            res = client.generate(prompt, 6, logprobs=True, top_logprobs=2, ignore_eos=True, **sampling)
            ref = torch.log_softmax(oracle.step_logits(prompt, res.token_ids).double(), dim=-1)    # [6, V]
            got = [lp.logprob for lp in res.logprobs]
            assert got == pytest.approx([float(ref[t, g]) for t, g in enumerate(res.token_ids)], abs=1e-4), sampling
            assert all(lp.top[0].logprob == pytest.approx(float(ref[t].max()), abs=1e-4)
                       for t, lp in enumerate(res.logprobs))


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("/v1/chat/completions", {"chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ("/v1/chat/completions", {"documents": [{"title": "a", "text": "b"}]}, "documents"),
    ("/v1/chat/completions", {"return_token_ids": True}, "return_token_ids"),
    ("/v1/completions", {"return_token_ids": True}, "return_token_ids"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_vllm_fields_that_change_the_answer_are_refused_not_ignored(served, route, extra, param):
    """A template of the request's own, documents, token ids in the response, a usage in every chunk: each had been
    dropped without a word (200 with the checkpoint's template, no ids, no usage), where docs/api.md promises a 400."""
    *_, url, _ = served
    body = {"prompt": "x", "messages": MESSAGES, "max_tokens": 2, **extra}
    status, err = raw(url, "POST", route, json.dumps(body).encode())
    assert (status, err["error"]["param"], err["error"]["code"]) == (400, param, "invalid_argument"), err


def test_an_empty_model_name_is_the_served_model_and_codes_read_alike(served):
    """"model": "" is the served model, as vLLM takes it (some clients send it): it had been a 404. The front's own
    400s carry the code the router's refusals carry ("400" against "invalid_argument")."""
    *_, url, _ = served
    for route in ("/v1/completions", "/v1/chat/completions"):
        status, ok = raw(url, "POST", route, json.dumps({"model": "", "prompt": "x", "messages": MESSAGES,
                                                         "max_tokens": 1}).encode())
        assert status == 200 and ok["usage"]["completion_tokens"] == 1, ok
    front_400 = raw(url, "POST", "/v1/completions", json.dumps({"prompt": "x", "top_p": 7}).encode())[1]
    router_400 = raw(url, "POST", "/v1/completions", json.dumps({"prompt": [10**6]}).encode())[1]
    assert front_400["error"]["code"] == router_400["error"]["code"] == "invalid_argument", (front_400, router_400)
    assert raw(url, "GET", "/v1/nowhere")[1]["error"]["code"] == "not_found"


def post(url: str, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def test_the_clients_request_id_names_the_response_and_is_echoed(served):
    """X-Request-Id (else vLLM's `request_id` field) is the response's id and comes back as a header, as vLLM's;
    two requests sent at once with one id both run (the router's calls add a part of their own), and one that is
    no id is a 400 naming the header. It had been ignored: every id a fresh uuid, no header."""
    *_, url, _ = served
    body = {"prompt": "x", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, headers, data = post(url, "/v1/completions", body, {"X-Request-Id": "trace-7f3a"})
    assert status == 200 and json.loads(data)["id"] == "cmpl-trace-7f3a" and headers["x-request-id"] == "trace-7f3a"
    status, headers, data = post(url, "/v1/chat/completions", {**body, "messages": MESSAGES, "stream": True},
                                 {"X-Request-Id": "trace-7f3b"})
    first = json.loads(data.split(b"\n\n")[0].removeprefix(b"data: "))
    assert status == 200 and first["id"] == "chatcmpl-trace-7f3b" and headers["x-request-id"] == "trace-7f3b"
    status, headers, data = post(url, "/v1/completions", {**body, "request_id": "from-body"}, {})
    assert json.loads(data)["id"] == "cmpl-from-body" and headers["x-request-id"] == "from-body"
    status, headers, data = post(url, "/v1/completions", body, {})
    generated = json.loads(data)["id"]
    assert headers["x-request-id"] == generated and generated.startswith("cmpl-") and len(generated) > 20
    with futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: post(url, "/v1/completions", body, {"X-Request-Id": "same"}), range(4)))
    assert [s for s, _, _ in got] == [200] * 4, got
    assert all(json.loads(d)["id"] == "cmpl-same" and json.loads(d)["usage"]["completion_tokens"] == 12
               for _, _, d in got)
    longest = "i" * 200                                  # the router's id (256 at most) holds it with its parts
    status, _, data = post(url, "/v1/completions", {**body, "prompt": ["x"] * 12}, {"X-Request-Id": longest})
    assert status == 200 and json.loads(data)["id"] == f"cmpl-{longest}", data
    status, _, data = post(url, "/v1/chat/completions", {**body, "messages": MESSAGES}, {"X-Request-Id": longest})
    assert status == 200 and json.loads(data)["id"] == f"chatcmpl-{longest}", data
    status, headers, data = post(url, "/v1/completions", body, {"X-Request-Id": ""})     # an empty one is none
    assert status == 200 and json.loads(data)["id"] == headers["x-request-id"] != "cmpl-", data
    for bad_id in ("has space", "x" * 201):
        status, headers, data = post(url, "/v1/completions", body, {"X-Request-Id": bad_id})
        assert (status, json.loads(data)["error"]["param"]) == (400, "X-Request-Id"), data
        assert "x-request-id" not in headers
    status, headers, data = post(url, "/v1/completions", {"prompt": "x", "top_p": 7}, {"X-Request-Id": "t-400"})
    assert status == 400 and headers["x-request-id"] == "t-400"                       # refusals echo it too


def test_the_tokenizers_eos_token_stops_generation_as_vllms_does(served):
    """The checkpoint's config.json names no EOS while its tokenizer's eos_token is </s> (257): sampling ran past
    </s> to max_tokens, where vLLM stops on the tokenizer's eos beside generation_config.json's."""
    *_, addr, _, _ = served
    eos = 257
    with Client(addr) as client:
        assert eos in client.model_info().eos_token_ids
        hits = 0
        for seed in range(24):
            res = client.generate([eos, 256, eos], 40, temperature=2.0, seed=seed)
            if eos in res.token_ids:
                hits += 1
                assert res.token_ids.index(eos) == len(res.token_ids) - 1 and res.finish_reason == "stop", res
                past = client.generate([eos, 256, eos], 40, temperature=2.0, seed=seed, ignore_eos=True)
                assert past.token_ids[:len(res.token_ids)] == res.token_ids and len(past.token_ids) == 40
        assert hits, "no seed sampled </s>: the test saw nothing stop"
