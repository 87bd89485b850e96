"""The checkpoint's recommended sampling (generation_config.json), given as vLLM gives it: to HTTP requests that
leave a field out, unless the front runs with --generation-config vllm; read by the router, handed out in
ModelInfo, and a value no request could carry is left out with a warning."""

from __future__ import annotations

import json
import logging

import pytest

from colibri.client import Client
from colibri.openai_api.errors import ApiError
from colibri.openai_api.protocol import parse_chat, parse_completion
from colibri_common.sampling_defaults import sampling_defaults
from colibri_common.tokenizer import Tokenizer
from tests.chat_fixtures import chat_checkpoint
from tests.conftest import fleet
from tests.test_openai_api import front

QWEN3 = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_the_fields_a_request_may_carry_are_read_and_others_said(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20.0, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN3, "max_new_tokens": 300}))
    assert sampling_defaults(tmp_path)["max_tokens"] == 300
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 7, "top_p": 0, "min_p": 0.1,
                                                                 "top_k": 2.5, "repetition_penalty": True}))
    with caplog.at_level(logging.WARNING):
        assert sampling_defaults(tmp_path) == {"min_p": 0.1}
    assert all(f"{name} " in caplog.text for name in ("temperature", "top_p", "top_k", "repetition_penalty"))
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}
    assert sampling_defaults(tmp_path / "nowhere") == {}


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_only_the_fields_a_request_leaves_out_take_the_defaults(parse):
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "top_p": 0.5, "temperature": None}
    sp = parse(body).with_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "min_p": 0.05}).sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (pytest.approx(0.6), 0.5, 20, pytest.approx(0.05))
    assert sp.repetition_penalty == 1.0
    assert parse(body).with_defaults({"top_k": -1.0}).sampling.top_k == 0          # -1: off, as 0 on the wire
    assert parse(body).with_defaults({}).sampling == parse(body).sampling
    # generation_config's max_new_tokens: chat's "as many as fit" is capped at it by the router (which knows the
    # prompt's length: a default over what fits must not refuse the request); completions' 16 at most it
    chat = parse is parse_chat
    sp = parse(body).with_defaults({"max_tokens": 7.0}).sampling
    assert (sp.max_tokens, sp.default_max_tokens) == ((0, 7) if chat else (7, 0))
    sp = parse(body).with_defaults({"max_tokens": 100.0}).sampling
    assert (sp.max_tokens, sp.default_max_tokens) == ((0, 100) if chat else (16, 0))
    assert parse({**body, "max_tokens": 50}).with_defaults({"max_tokens": 7.0}).sampling.max_tokens == 50


def test_the_front_gives_the_checkpoints_sampling_to_requests_that_leave_it_out(tmp_path):
    """top_k 1 in generation_config.json: a request at temperature 1 that sets no top_k is greedy (transformers'
    tokens); one that sets top_k 0, or any through a front with --generation-config vllm, samples."""
    path = tmp_path / "gen"
    oracle, _ = chat_checkpoint(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 257, "top_k": 1}))
    tok = Tokenizer.from_dir(path)
    prompt = "Once upon"
    greedy = tok.decode(oracle.greedy(tok.encode(prompt, True), 12))
    kw = {"model": "gen", "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 3,
          "extra_body": {"ignore_eos": True}}
    with fleet(path, 1, ["--openai-port", "0"]) as (addr, proc):
        with Client(addr) as client:
            assert dict(client.model_info().sampling_defaults) == {"top_k": 1.0}
            # a default max_tokens caps "as many as fit" on the router, and one over what fits refuses nothing
            fit = client.model_info().max_model_len - 3
            assert len(client.generate([1, 2, 3], 0, ignore_eos=True, default_max_tokens=4).token_ids) == 4
            assert len(client.generate([1, 2, 3], 0, ignore_eos=True, default_max_tokens=10**6).token_ids) == fit
            assert len(client.generate([1, 2, 3], 0, ignore_eos=True, default_max_tokens=2,
                                       min_tokens=5).token_ids) == 5
        with front(addr) as (_, _, api):
            assert api.completions.create(**kw).choices[0].text == greedy
            sampled = api.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "top_k": 0}})
            assert sampled.choices[0].text != greedy
        with front(addr, "--generation-config", "vllm") as (_, _, api):
            assert api.completions.create(**kw).choices[0].text == sampled.choices[0].text


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_min_tokens_over_the_checkpoints_max_tokens_is_refused_on_both_routes(parse):
    """chat had served min_tokens 8 over generation_config's max_new_tokens 5 (its limit quietly raised) where
    completions refused it: both refuse it now, naming where the limit came from (vLLM refuses it on both)."""
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "min_tokens": 8}
    with pytest.raises(ApiError) as err:
        parse(body).with_defaults({"max_tokens": 5.0}).check_min_tokens(16)
    assert (err.value.status, err.value.param) == (400, "min_tokens")
    assert "left out: 5 from this model's generation_config.json (max_new_tokens)" in err.value.message
    parse({**body, "max_tokens": 9}).with_defaults({"max_tokens": 5.0}).check_min_tokens(16)     # given: the router's
    parse(body).with_defaults({"max_tokens": 8.0}).check_min_tokens(16)
