"""Options are defined once: flags, defaults and validation come from the dataclasses; serve's children
get their options back through `to_argv`; bad flags are one clear line, never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colibri import __version__
from colibri.cli import COMMANDS, build_parser
from colibri.fleet import child_argv
from colibri.openai_api.options import OpenAIOptions
from colibri.serve_options import ServeOptions
from colibri_common.errors import ConfigError
from colibri_common.flags import Parser, _flags, add_options, from_args, option, to_argv
from expert_service.options import ExpertCacheOptions, ExpertOptions
from router_service.api.options import RouterOptions
from router_service.engine.scheduler import SchedulerConfig
from router_service.engine.sequence import Sampling
from tests.conftest import COLIBRI


def parse(cls: type, argv: list[str], exclude: tuple[str, ...] = ()):
    p = Parser(prog="t")
    add_options(p, cls, exclude)
    return from_args(cls, p.parse_args(argv))


def test_defaults_come_from_the_dataclasses():
    r = parse(RouterOptions, ["--model", "m", "--workers", "a:1,b:2"])
    assert r == RouterOptions(model="m", workers=("a:1", "b:2"))
    assert r.sched == SchedulerConfig() and r.port == 50051
    e = parse(ExpertOptions, ["--model", "m", "--shard", "1/3"])
    assert (e.port, e.shard_index, e.num_shards) == (50061, 1, 3)


def test_every_field_is_a_flag_and_round_trips_through_to_argv():
    r = RouterOptions(model="/m", workers=("h:1", "h:2"), host="0.0.0.0", port=7, dtype="bfloat16", threads=3,
                      log_level="DEBUG", kv_cache_mb=64, kv_cache_blocks=9, block_size=8, wire_dtype="float32",
                      micro_batches=2, transport="unary", worker_timeout=2.5, metrics_port=0, quantize="w8a8",
                      batch_invariant=True,
                      grace_period=3.5, max_prompt_bytes=1000, max_request_bytes=9000, max_stop_token_ids=7,
                      max_stop_strings=5, stream_stall_timeout=4.5, expert_metrics=True, tls_client_auth=True,
                      tls_cert="/c.pem", tls_key="/k.pem", tls_ca="/ca.pem",
                      quantize_dense=True, cpu_forms="/tmp/forms.json", expert_prefetch=True, expert_replicas=2,
                      redundant_experts=3, placement_window=64, rebalance_interval=30.0, worker_load_timeout=60.0,
                      follow_interval=2.0, replan_dead_after=20.0, weights_in_place="off",
                      sched=SchedulerConfig(max_batch_size=5, max_num_tokens=6, max_waiting=7, max_model_len=99,
                                            routing_aware_batching=True, max_passed_over=3))
    gpu = dataclasses.replace(r, device="cuda:1", quantize=None, quantize_dense=False,   # int8 is CPU-only
                              batch_invariant=False, workers=(), follow_workers="experts.llm.svc:50061",
                              enforce_eager=True)
    changed = {f.name for o in (r, gpu) for f in dataclasses.fields(o)
               if getattr(o, f.name) != getattr(RouterOptions(), f.name)}
    assert changed == {f.name for f in dataclasses.fields(RouterOptions)}        # the test sets every field
    assert all(getattr(r.sched, f.name) != getattr(SchedulerConfig(), f.name) for f in dataclasses.fields(r.sched))
    for opts in (r, gpu):
        argv = child_argv("router", opts)
        assert argv[0] == "router"
        assert parse(RouterOptions, argv[1:]) == opts
    e = ExpertOptions(model="/m", shard="2/4", port=0, threads=1, log_level="WARNING", max_streams_per_peer=3,
                      max_step_tokens=2048)
    assert parse(ExpertOptions, child_argv("expert", e)[1:]) == e
    c = ExpertCacheOptions(expert_cache_capacity="3/layer", expert_cache_policy="lfu", expert_cache_half_life=9.5,
                           expert_cache_host_capacity="2GiB", expert_cache_heat="/h.json", quantized_experts="keep",
                           experts_in_place="off")
    assert all(getattr(c, f.name) != getattr(ExpertCacheOptions(), f.name) for f in dataclasses.fields(c))
    e = dataclasses.replace(e, cache=c)
    assert parse(ExpertOptions, child_argv("expert", e)[1:]) == e
    o = OpenAIOptions(target="h:9", host="0.0.0.0", port=8001, served_model_name="m", request_timeout=5.5,
                      max_body_bytes=1000, max_header_bytes=4096, request_read_timeout=3.5,
                      grace_period=2.5, tls_ca="/ca.pem", tls_cert="/c.pem", tls_key="/k.pem", access_log=True,
                      log_level="DEBUG", api_key="k", allowed_hosts=("h",), allowed_origins=("https://o.example",),
                      generation_config="vllm", sse_keepalive=2.0, stream_stall_timeout=7.5)
    assert all(getattr(o, f.name) != getattr(OpenAIOptions(), f.name) for f in dataclasses.fields(o))
    assert parse(OpenAIOptions, child_argv("openai", o)[1:]) == o


def test_serve_starts_the_openai_front_as_a_client_of_its_router():
    s = parse(ServeOptions, ["--model", "/models/qwen", "--openai-port", "8080", "--tls-cert", "/c", "--tls-key",
                             "/k", "--tls-ca", "/ca", "--log-level", "warning"], ServeOptions.EXCLUDED)
    front = s.front("127.0.0.1:5000")
    assert (front.target, front.port, front.served_model_name, front.tls_ca) == ("127.0.0.1:5000", 8080, "qwen",
                                                                                 "/ca")
    stalls = parse(ServeOptions, ["--model", "/m", "--openai-port", "0", "--stream-stall-timeout", "9"],
                   ServeOptions.EXCLUDED)
    assert stalls.front("h:1").stream_stall_timeout == 9.0          # the front drops a stuck stream as the router
    assert front.tls_cert is None and front.log_level == "WARNING"      # no client auth: no client certificate
    with pytest.raises(ValueError, match="--openai-port"):
        parse(ServeOptions, ["--model", "/m", "--openai-port", "70000"], ServeOptions.EXCLUDED)
    with pytest.raises(ValueError, match="--tls-key"):
        parse(OpenAIOptions, ["--target", "h:1", "--tls-cert", "/c"])     # a certificate without its key


def test_serve_hands_its_children_the_options_it_was_given():
    s = parse(ServeOptions, ["--model", "/m", "--workers", "3", "--dtype", "bfloat16", "--log-level", "warning",
                             "--max-batch-size", "4", "--micro-batches", "2", "--expert-cache-capacity", "25%",
                             "--routing-aware-batching"], ServeOptions.EXCLUDED)
    assert s.workers == 3 and s.router.sched.max_batch_size == 4 and s.router.log_level == "WARNING"
    assert s.router.sched.routing_aware_batching
    e = s.expert(2, threads=1)
    assert e.cache == ExpertCacheOptions(expert_cache_capacity="25%")         # every worker gets the cache flags
    e = dataclasses.replace(e, cache=ExpertCacheOptions())
    assert e == ExpertOptions(model="/m", dtype="bfloat16", log_level="WARNING", host="127.0.0.1", port=0,
                              threads=1, shard="2/3")
    router = dataclasses.replace(s.router, workers=("127.0.0.1:1",), threads=2)
    router_argv = child_argv("router", router)
    assert parse(RouterOptions, router_argv[1:]) == router          # the child rebuilds exactly these options
    assert parse(ExpertOptions, child_argv("expert", e)[1:]) == e


def test_serve_gpus_places_the_router_on_the_first_and_workers_round_robin():
    s = parse(ServeOptions, ["--model", "/m", "--workers", "3", "--gpus", "2,5"], ServeOptions.EXCLUDED)
    assert [s.expert(i, threads=1).device for i in range(3)] == ["cuda:2", "cuda:5", "cuda:2"]
    router = s.router_options(("127.0.0.1:1",), 2)
    assert router.device == "cuda:2" and router.workers == ("127.0.0.1:1",)
    assert "--device=cuda:5" in child_argv("expert", s.expert(1, threads=1))
    plain = parse(ServeOptions, ["--model", "/m", "--device", "cuda"], ServeOptions.EXCLUDED)
    assert plain.expert(1, threads=1).device == "cuda" and plain.router_options((), 1).device == "cuda"


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--model", "m", "--device", "tpu"], "--device 'tpu' is not a device; use cpu, cuda or cuda:N"),
    (["expert", "--model", "m", "--shard", "0/1", "--device", "cuda", "--quantize", "int8"],
     "--quantize int8 is the CPU path"),
    (["expert", "--model", "m", "--shard", "0/1", "--device", "cuda", "--quantize", "w8a8"],
     "--quantize w8a8 is the CPU path"),
    (["router", "--model", "m", "--workers", "a:1", "--device", "cuda", "--batch-invariant"],
     "--batch-invariant runs on CPUs"),
    (["serve", "--model", "m", "--quantize", "int4"], "invalid choice: 'int4'"),
    (["serve", "--model", "m", "--gpus", "0", "--batch-invariant"], "--batch-invariant runs on CPUs"),
    (["serve", "--model", "m", "--gpus", "0", "--device", "cuda:1"], "give --gpus (one GPU per child) or --device"),
    (["serve", "--model", "m", "--gpus", "0,x"], "invalid comma-separated int value"),
    (["serve", "--model", "m", "--gpus", "0", "--quantize", "int8"], "are the CPU path; on GPUs serve bfloat16"),
    (["serve", "--model", "m", "--log-level", "NOPE"], "invalid choice: 'NOPE'"),
    (["serve", "--model", "m", "--max-batch-size", "0"], "--max_batch_size must be positive"),
    (["router", "--model", "m", "--workers", "a:1", "--micro-batches", "0"], "--micro-batches must be positive"),
    (["expert", "--model", "m", "--shard", "3/2"], "--shard 3/2: need 0 <= I < N"),
    (["expert", "--model", "m", "--shard", "x"], "--shard must look like I/N"),
    (["serve", "--model", "m", "--workers", "0"], "--workers must be positive"),
    (["serve", "--model", "m", "--threads", "-1"], "--threads must be >= 0"),
    (["serve", "--model", "m", "--threads", "100000"], "--threads 100000 is more than 4 x this machine's"),
    (["tune", "--model", "m", "--threads", "999"], "--threads 999 is more than 4 x this machine's"),   # was taken
    (["serve", "--model", "m", "--metrics-port", "99999"], "--metrics-port must be in 0..65535"),
    (["expert", "--model", "m", "--shard", "0/1", "--metrics-port", "-2"], "--metrics-port must be in 0..65535"),
    (["serve", "--model", "m", "--spawn", "fork", "--gpus", "0"], "--spawn fork is for CPU fleets"),
    (["serve", "--model", "m", "--spawn", "thread"], "invalid choice: 'thread'"),
    (["serve", "--model", "m", "--worker-cpus", "0,1"], "invalid choice: '0,1'"),
    (["expert", "--model", "m", "--shard", "0/1", "--cpus", "a-b"], "--cpus 'a-b': give CPU numbers and ranges"),
    (["expert", "--model", "m", "--shard", "0/1", "--cpus", "3-1"], "'3-1' is not a CPU number or a rising range"),
    (["expert", "--model", "m", "--shard", "0/1", "--cpus", "0,,1"], "give CPU numbers and ranges"),
    # values a request cannot carry: protobuf's 'Value out of range' was a traceback
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1,2", "--max-tokens", "99999999999"],
     "max_tokens must be at most 2147483647, got 99999999999"),
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1", "--seed", "-1"], "a seed is a whole number in [0, "
     "2**64)"),
    # (2**63 and up had been refused as past an int64 flag, contradicting the seed's own range)
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1", "--seed", str(2**64)], "a seed is a whole number in "
     "[0, 2**64)"),
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "99999999999"], "prompt token ids cannot be sent"),
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1", "--stop-token-ids", "99999999999"],
     "stop_token_ids must be token ids in [0, 2147483647], got [99999999999]"),
    (["generate", "--target", "127.0.0.1:1", "--prompt", "bad \udcff"], "the prompt is not valid UTF-8 text"),
    # an empty stop string ("$UNSET", "a,,b") was dropped without a word: the request ran with no stop
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1", "--stop", ""], "holds an empty string"),
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1", "--stop", "a,,b"], "holds an empty string"),
    (["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1", "--stop", "a\\q"], "unknown escape"),
    (["bench", "--target", "127.0.0.1:1", "--max-tokens", "99999999999"], "--max-tokens must be from 1 to"),
    # an unset variable as the target (gRPC's internal trace), a port past 65535 (dialled modulo 65536)
    (["generate", "--target", "", "--prompt-ids", "1"], "--target is empty (an unset variable?): it needs a value"),
    (["openai", "--target", " "], "--target is empty"),
    (["openai", "--target", "127.0.0.1:1", "--api-key", ""], "--api-key is empty (an unset variable?)"),
    (["serve", "--model", ""], "--model is empty"),
    (["health", "--target", "127.0.0.1:99999"], "--target 127.0.0.1:99999: the port must be in 1..65535"),
    (["workers", "--target", "h:0"], "the port must be in 1..65535"),
    (["health", "--target", "127.0.0.1:1", "--timeout", "-1"], "--timeout must be positive"),
    # serve's own ports and the front's flags, checked before anything is forked (they were tracebacks, or
    # "Address already in use" from a child once the fleet had loaded)
    (["serve", "--model", "m", "--metrics-port", "65534"], "up to 65536 for 2 workers, past 65535: give at most 65533"),
    (["serve", "--model", "m", "--port", "50400", "--metrics-port", "50400"], "--metrics-port and --port are both"),
    (["serve", "--model", "m", "--port", "50401", "--metrics-port", "50400"],
     "worker 0's metrics port (--metrics-port + 1) and --port are both 50401"),
    (["serve", "--model", "m", "--openai-port", "50402", "--metrics-port", "50400"],
     "worker 1's metrics port (--metrics-port + 2) and --openai-port are both 50402"),
    (["serve", "--model", "m", "--port", "8000", "--openai-port", "8000"], "--openai-port and --port are both 8000"),
    (["serve", "--model", "m", "--openai-port", "0", "--allowed-origins", "not a url"], "is not a web origin"),
    (["serve", "--model", "m", "--openai-port", "0", "--allowed-hosts", "http://x/y"], "is not a host name"),
    (["serve", "--model", "m", "--allowed-origins", "https://a.example"], "--allowed-origins is for the HTTP front"),
    (["serve", "--model", "m", "--served-model-name", "x", "--allowed-hosts", "h"],
     "--served-model-name, --allowed-hosts are for the HTTP front: give --openai-port too"),
    (["serve", "--model", "m", "--tls-cert", "c.pem"], "give --tls-cert and --tls-key together"),
    # an empty value (`--flag "$UNSET"`) is not taken as the default without a word
    (["serve", "--model", "m", "--openai-port", "0", "--served-model-name", " "], "--served-model-name ' ' is blank"),
    (["openai", "--target", "h:1", "--served-model-name", ""], "--served-model-name '' is blank"),
    (["openai", "--target", "h:1", "--served-model-name", "qwen "], "starts or ends with white space"),
    (["serve", "--model", "m", "--openai-port", "0", "--allowed-hosts", ""], "--allowed-hosts: '' lists nothing"),
    (["openai", "--target", "h:1", "--allowed-origins", " , "], "--allowed-origins: ' , ' lists nothing"),
    (["router", "--model", "m", "--workers", ""], "--workers: '' lists nothing"),
    (["router", "--model", "m", "--workers", "a:1,"], "--workers: 'a:1,' holds an empty item"),
    (["generate", "--target", "h:1", "--prompt-ids", "5,,6"], "--prompt-ids: '5,,6' holds an empty item"),
    (["generate", "--target", "h:1", "--prompt-ids", "-1"], "--prompt-ids: token ids are 0 or more, got -1"),
    # 0 is the wire's "unset" (off): a user typing it means near-greedy, and gets told
    (["generate", "--target", "h:1", "--prompt-ids", "1", "--top-p", "0"], "--top-p must be in (0, 1] (1 = off)"),
    (["router", "--model", "m", "--workers", "a:1,garbage"], "--workers garbage: give each expert worker as HOST:PORT"),
    (["router", "--model", "m", "--workers", "::1"], "--workers ::1: give each expert worker as HOST:PORT"),
    (["router", "--model", "m", "--workers", "[::1]"], "--workers [::1]: give each"),
    (["router", "--model", "m", "--workers", "h:"], "--workers h:: give each"),
    (["router", "--model", "m", "--workers", "a b:1"], "--workers a b:1: give each"),   # was waited on as an outage
    (["generate", "--target", "h:1", "--prompt-ids", "1", "--top-p", "2"], "top_p must be in (0, 1] (1 = off)"),
    (["generate", "--target", "h:1", "--prompt-ids", "1", "--temperature", "1e308"],   # inf on the wire (float32)
     "temperature must be a finite number >= 0 (0 = greedy), got 1e+308"),
    (["expert", "--model", "m", "--shard", "-1/2"], "--shard -1/2: need 0 <= I < N"),  # "expected one argument"
    (["serve", "--modle", "m"], "required: --model (did you mean --model for --modle?)"),
    (["serve", "--verbose", "--modle", "m"], "required: --model (did you mean --model for --modle?)"),
    (["health", "--target", "[::1]"], "--target [::1]: give HOST:PORT (the port the router's or serve's `ready` line "
                                      "names; an IPv6 address in brackets: [::1]:50051)"),
    (["health", "--target", "dns:///h:99999"], "the port must be in 1..65535"),
    (["health", "--target", "127.0.0.1:-5"], "the port must be in 1..65535"),          # gRPC dialled 65531
    (["generate", "--target", "h:port", "--prompt-ids", "1"], "--target h:port: the port must be in 1..65535"),
    # whole numbers past what gRPC or torch take: OverflowError tracebacks from the child that met them
    (["serve", "--model", "m", "--kv-cache-mb", "99999999999999999999"],
     "--kv-cache-mb: 99999999999999999999 is past the largest whole number a flag takes (2**63 - 1)"),
    (["serve", "--model", "m", "--max-request-bytes", "3000000000"], "is past gRPC's largest message"),
    (["generate", "--target", "h:1", "--prompt-ids", "1,99999999999999999999"], "past the largest whole number"),
])
def test_bad_flags_are_one_clear_line_and_exit_2(argv, needle):
    out = subprocess.run([COLIBRI, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle.replace("_", "-") in lines[0].replace("_", "-"), out.stderr
    assert "Traceback" not in out.stderr


def test_negative_values_in_any_notation_are_values_not_flags():
    from colibri.generate import GenerateOptions

    opts = parse(GenerateOptions, ["--target", "h:1", "--prompt-ids", "1", "--presence-penalty", "-1e-3"])
    assert opts.sampling.presence_penalty == -1e-3      # argparse took "-1e-3" for a flag: "expected one argument"


def test_worker_addresses_as_kubernetes_and_ipv6_give_them_are_taken():
    for address in ("w-0.w.llm.svc.cluster.local:50061", "[::1]:50061", "10.0.0.5:1", "localhost:65535"):
        assert parse(RouterOptions, ["--model", "m", "--workers", address]).workers == (address,)


def test_serve_knows_its_fixed_ports_and_chooses_none_of_them():
    from colibri.fleet import CHOSEN_FROM, check_ports_free, ephemeral_range, free_ports

    opts = parse(ServeOptions, ["--model", "m", "--workers", "3", "--port", "50051", "--metrics-port", "9300",
                                "--openai-port", "0"], ServeOptions.EXCLUDED)
    assert [p for _, _, p in opts.fixed_ports()] == [50051, 9300, 9301, 9302, 9303]     # 0: chosen at start
    assert {h for _, h, _ in opts.fixed_ports()} == {"127.0.0.1"}
    # --metrics-port 0: the router's chosen port reaches it without the P + 1 + i check (it was put into the options,
    # whose check then read the chosen port as P and could refuse it)
    chosen = parse(ServeOptions, ["--model", "m", "--metrics-port", "0"], ServeOptions.EXCLUDED)
    assert chosen.router_options(("127.0.0.1:1",), 1, 65535).metrics_port == 65535
    taken = free_ports(4)
    assert not set(free_ports(6, frozenset(taken))) & set(taken)
    if ephemeral_range()[0] - CHOSEN_FROM >= 1000:     # below the range that outgoing connections take ports from
        assert all(CHOSEN_FROM <= p < ephemeral_range()[0] for p in taken)
    check_ports_free([("--port", host, 0) for host in ("0.0.0.0", "127.0.0.1")])      # port 0: any free one
    with pytest.raises(ConfigError, match="--host nonsense.invalid: no address of this machine by that name"):
        check_ports_free([("--port", "nonsense.invalid", 50051)])                # it blamed --port
    with pytest.raises(ConfigError, match="--host 192.0.2.1: not an address of this machine"):   # TEST-NET-1
        check_ports_free([("--port", "192.0.2.1", 0)])


def test_stop_strings_are_kept_as_typed_with_escapes():
    """Stop strings are text, not names: leading spaces and newlines are what they match (the comma-list parser
    stripped them, so `--stop $'\\n'` was no stop at all); a comma or backslash inside one is escaped."""
    from colibri.generate import GenerateOptions

    def stop(text: str) -> tuple[str, ...]:
        return parse(GenerateOptions, ["--target", "h:1", "--prompt-ids", "1", "--stop", text]).sampling.stop

    assert stop(" the,\\n") == (" the", "\n")                  # the escape
    assert stop("\n\n,\t") == ("\n\n", "\t")                     # the characters themselves ($'\n')
    assert stop("a\\,b,c\\\\d") == ("a,b", "c\\d")
    assert stop("\\r\\t") == ("\r\t",)
    odd = (" the", "\n\n", "a,b", "c\\d", "\t")                     # and back through to_argv, as a child gets it
    argv = to_argv(GenerateOptions(target="h:1", prompt_ids=(1,), sampling=Sampling(stop=odd)))
    assert stop(next(a for a in argv if a.startswith("--stop=")).split("=", 1)[1]) == odd


def test_the_cli_starts_without_torch_or_grpc():
    """--help, --version and flag errors answer at once: the heavy imports wait for a command to run."""
    code = "import sys, colibri.cli; print(sorted(m for m in ('torch', 'grpc', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_version_and_help():
    out = subprocess.run([COLIBRI, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"colibri {__version__}"
    help_text = subprocess.run([COLIBRI, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--workers", "--max-batch-size", "--kv-cache-mb", "--transport", "--worker-timeout"):
        assert flag in help_text
    assert "(default: 64)" in help_text                       # defaults shown, from the dataclass


def test_cli_py_writes_no_default_and_every_command_has_an_options_dataclass():
    """Defaults live on the options' fields; cli.py only wires commands to them."""
    source = (Path(__file__).resolve().parent.parent / "colibri" / "cli.py").read_text()
    assert "default=" not in source
    assert re.findall(r'add_argument\("(--[a-z-]+)"', source) == ["--version"]
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    for name, parser in sub.choices.items():
        flags = {a.dest for a in parser._actions if a.dest != "help"}
        fields = {f.path.replace(".", "__") for f in _flags(COMMANDS[name].options,
                                                             getattr(COMMANDS[name].options, "EXCLUDED", ()))}
        assert flags == fields, name


@dataclasses.dataclass(frozen=True)
class Inner:
    size: int = option(64, "a size")


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = Inner(size=8)
    flag: bool | None = option(None, "a tri-state")
    ids: tuple[int, ...] = option((), "ids")
    ratio: float | None = option(0.5, "50% of it")
    name: str = option("x", "a name")


def test_nested_defaults_optional_and_tuple_fields():
    assert parse(Outer, []) == Outer()                                  # the parent's nested default, 8
    o = Outer(Inner(64), False, (3, -4), 0.25, "-dash")
    assert parse(Outer, to_argv(o)) == o
    with pytest.raises(ValueError, match="no flag can say None"):
        to_argv(Outer(ratio=None))
    p = Parser(prog="t")
    add_options(p, Outer)
    assert "50% of it" in p.format_help()


def test_ctrl_c_in_a_tool_is_one_line_and_exit_130():
    """`colibri tune` (or bench waiting for its router) stopped with Ctrl-C printed a KeyboardInterrupt traceback."""
    import signal
    import time

    # A test run started in the background by a shell without job control (`make test &` in a script) ignores
    # SIGINT, and a child inherits that (as it must: nohup's way), so bench would take no Ctrl-C: it starts here
    # with SIGINT's default, as from a terminal.
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([COLIBRI, "bench", "--target", "127.0.0.1:1", "--ready-timeout", "60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, ignored)
    told = p.stderr.readline()                   # it says once that it waits for a router that never comes
    assert "waiting up to 60 s" in told, told
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "colibri bench: interrupted" in err and "Traceback" not in err, err


def test_a_child_s_exit_is_explained_in_serve_s_log():
    from colibri.fleet import exit_reason

    assert "SIGBUS: a read through a mapped file" in exit_reason(-7)
    assert "SIGKILL: killed: the kernel's OOM killer" in exit_reason(-9)
    assert "maps them afresh" in exit_reason(75) and exit_reason(1) == "" and exit_reason(None) == ""


def test_keyword_options_are_checked_and_converted_as_their_flags_are():
    """The Python API's keywords (LLM(...)) against the flags' types: paths, numpy integers and 0 / 1 are taken
    as a user means them; a string for a number, a bool for a count and a value outside the choices are not."""
    import numpy as np

    from colibri_common.flags import check_values

    got = check_values(RouterOptions, {"cpu_forms": Path("/tmp/f.json"), "batch_invariant": 1,
                                       "threads": np.int64(2), "workers": ["a:1", "b:2"]}, "LLM")
    assert got == {"cpu_forms": "/tmp/f.json", "batch_invariant": True, "threads": 2, "workers": ("a:1", "b:2")}
    assert type(got["threads"]) is int
    for bad, error, needle in [({"threads": "two"}, TypeError, "threads must be int, got 'two'"),
                               ({"threads": True}, TypeError, "threads must be int"),
                               ({"batch_invariant": 2}, TypeError, "batch_invariant must be bool"),
                               ({"dtype": "BFLOAT16"}, ValueError, "dtype='BFLOAT16' is not one of"),
                               ({"kv_cache_mb": 10**20}, ValueError, r"kv_cache_mb=10+ is past the largest")]:
        with pytest.raises(error, match=needle):
            check_values(RouterOptions, bad, "LLM")


def test_a_mistyped_flag_is_named_by_its_command_with_the_flag_it_resembles():
    """It was the top-level parser's error, pointing at `colibri --help`, with no suggestion."""
    out = subprocess.run([COLIBRI, "serve", "--model", "x", "--openai-prot", "8000"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "colibri serve: error: unrecognized arguments: --openai-prot 8000" in out.stderr
    assert "did you mean --openai-port?" in out.stderr and "see 'colibri serve --help'" in out.stderr


def test_a_target_without_a_port_is_refused_before_dialling():
    """gRPC dialled `localhost` on port 443 and failed with its own words."""
    out = subprocess.run([COLIBRI, "generate", "--target", "localhost", "--prompt-ids", "1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--target localhost: give HOST:PORT" in out.stderr, out.stderr


def test_an_empty_api_key_variable_is_refused():
    """An empty Secret behind $COLIBRI_API_KEY started an open front: a key was meant, so it is refused, as an
    empty --api-key is."""
    from colibri.openai_api.options import OpenAIOptions
    from colibri.openai_api.policy import api_key

    with pytest.raises(ValueError, match="COLIBRI_API_KEY is set but empty"):
        api_key(OpenAIOptions(target="r:1"), {"COLIBRI_API_KEY": " "})
    assert api_key(OpenAIOptions(target="r:1"), {}) == ("", "")


def test_a_reader_that_leaves_early_is_no_traceback(oracles):
    """`colibri workers show | head -n 4` printed a BrokenPipeError traceback when head left first."""
    p = subprocess.Popen([COLIBRI, "validate", "--model", str(oracles["qwen3_moe"].path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()                                   # the reader is gone before the first line is written
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err



def test_a_checkpoint_this_user_may_not_read_is_one_line_naming_the_file(oracles, tmp_path):
    """A safetensors file without read permission for the service's user (a pod's runAsUser against a volume's
    owner) was a PermissionError traceback from validate, serve and expert. As root, the test drops the capabilities
    that let root read any file (setpriv)."""
    import os
    import shutil

    model = tmp_path / "model"
    shutil.copytree(oracles["qwen3_moe"].path, model)
    (target,) = model.glob("*.safetensors")
    target.chmod(0)
    prefix = []
    if os.getuid() == 0:
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
        if shutil.which("setpriv") is None or subprocess.run([*prefix, "cat", str(target)],
                                                             capture_output=True).returncode == 0:
            pytest.skip("root reads every file here: no setpriv to drop the capabilities that let it")
    for argv in (["validate", "--model", str(model)], ["serve", "--model", str(model), "--workers", "1", "--port", "0"],
                 ["expert", "--model", str(model), "--shard", "0/1", "--port", "0"]):
        out = subprocess.run([*prefix, COLIBRI, *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"error: {target}: permission denied for this process" in out.stderr, out.stderr[-2000:]


def test_gpus_on_a_machine_without_them_names_the_flag_given(oracles):
    """`serve --gpus 0` where CUDA is missing blamed --device, a flag the user had not typed."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([COLIBRI, "serve", "--model", str(oracles["qwen3_moe"].path), "--gpus", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "error: --gpus 0 (cuda:0): this machine has no usable CUDA GPU" in out.stderr, out.stderr[-2000:]
    assert "--device" not in out.stderr and "leave --gpus out" in out.stderr


def test_a_target_that_speaks_http1_is_named_as_such():
    """`--target` at the OpenAI front's port (or any web server) gave gRPC's own framing error and nothing more."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target = f"127.0.0.1:{server.server_address[1]}"
    try:
        for argv in (["generate", "--target", target, "--prompt-ids", "1"], ["health", "--target", target]):
            out = subprocess.run([COLIBRI, *argv], capture_output=True, text=True, timeout=60)
            assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
            assert "the target answers HTTP/1, not gRPC" in out.stderr, out.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_a_seed_flag_takes_the_whole_uint64_range_a_request_carries():
    from colibri.cli import build_parser, command_options

    ap = build_parser()
    for seed in (0, 2**63, 2**64 - 1):
        args = ap.parse_args(["generate", "--target", "127.0.0.1:1", "--prompt-ids", "1", "--seed", str(seed)])
        assert command_options(ap, args).sampling.seed == seed
