"""A worker whose checkpoint changes under its mapping never faults on it: the change is seen (the file named),
the mapping is not read any more, the worker goes NOT_SERVING and stops with exit code 75 for a restart to map
the files afresh; experts whose weights give non-finite outputs for finite inputs are named (layer, expert,
file) and stop the worker the same way. A router that uses its embedding and lm_head in place does the same:
its open requests end UNAVAILABLE (retryable) with the file named, and it exits 75."""

from __future__ import annotations

import shutil
import subprocess
import time

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri.client import Client, GenerationError
from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from tests.conftest import colibri_popen

RESTART = 75


def start_worker(model, *extra: str):
    p = colibri_popen(["expert", "--model", str(model), "--shard", "0/1", "--port", "0", "--cpu-forms", "off",
                       "--expert-cache-heat", "off", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline()
    if not line.startswith("ready "):
        _, err = p.communicate(timeout=30)
        raise RuntimeError(f"the worker did not start: {err[-2000:]}")
    return p, line.split()[1]


def forward(stub, cfg: ModelConfig, layer: int, experts: list[int]):
    n = len(experts)
    g = torch.Generator().manual_seed(layer)
    return stub.Forward(expert_pb2.ForwardRequest(
        layer=layer, hidden=wire.encode(torch.randn(n, cfg.hidden_size, generator=g)),
        topk_ids=wire.encode(torch.tensor(experts)[:, None]), topk_weights=wire.encode(torch.ones(n, 1))), timeout=30)


def finish(p) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"the worker did not stop: {err[-2000:]}")
    return p.returncode, err


@pytest.fixture
def model(oracles, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(oracles["qwen3_moe"].path, path)
    return path


@pytest.mark.parametrize("held", [["--expert-cache-capacity", "25%"], []], ids=["cache", "in-place"])
def test_a_checkpoint_truncated_under_the_worker_is_named_and_never_faulted_on(model, held):
    cfg = ModelConfig.from_dir(model)
    p, addr = start_worker(model, *held)
    layer = cfg.moe_layers[0]
    with grpc.insecure_channel(addr) as ch:
        stub = expert_pb2_grpc.ExpertWorkerStub(ch)
        forward(stub, cfg, layer, [0, 1])                                  # packed from the mapping: fine
        files = sorted(model.glob("*.safetensors"))
        with open(files[0], "r+b") as f:                                   # half of it gone under the mapping
            f.truncate(files[0].stat().st_size // 2)
        codes = []
        for e in range(2, cfg.num_experts, 2):                             # misses: each would read the mapping
            try:
                forward(stub, cfg, layer, [e, e + 1])
            except grpc.RpcError as exc:
                codes.append(exc.code())
                if exc.code() == grpc.StatusCode.UNAVAILABLE and exc.details():
                    assert files[0].name in exc.details() or "not serving" in exc.details().lower() or \
                        "loading" in exc.details(), exc.details()
                break
            time.sleep(0.05)
        assert codes, "every call after the truncation was answered from the mapping"
    code, err = finish(p)
    assert code == RESTART, f"exit {code} (a SIGBUS is -7): {err[-2000:]}"
    assert f"{files[0]} changed size while mapped" in err


def test_experts_with_non_finite_weights_are_named_and_stop_the_worker(model):
    cfg = ModelConfig.from_dir(model)
    layer = cfg.moe_layers[-1]
    (f,) = model.glob("*.safetensors")
    tensors = load_file(f)
    name = next(n for n in tensors if f"layers.{layer}.mlp.experts.3.down_proj" in n)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    p, addr = start_worker(model)
    with grpc.insecure_channel(addr) as ch:
        stub = expert_pb2_grpc.ExpertWorkerStub(ch)
        forward(stub, cfg, layer, [1, 2])                                  # healthy experts answer
        with pytest.raises(grpc.RpcError) as exc:
            forward(stub, cfg, layer, [1, 3, 5])
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"layer {layer} expert 3 give" in exc.value.details() and str(f) in exc.value.details(), \
        exc.value.details()
    code, err = finish(p)
    assert code == RESTART and f"layer {layer} expert 3" in err


def test_a_checkpoint_overwritten_in_place_is_named_and_the_worker_stops_for_a_restart(model):
    cfg = ModelConfig.from_dir(model)
    p, addr = start_worker(model, "--expert-cache-capacity", "25%")
    (f,) = model.glob("*.safetensors")
    with grpc.insecure_channel(addr) as ch:
        forward(expert_pb2_grpc.ExpertWorkerStub(ch), cfg, cfg.moe_layers[0], [0, 1])
        size = f.stat().st_size
        with open(f, "r+b") as out:                                         # NaN bytes over its second half
            out.seek(size // 2)
            out.write(b"\xff" * (size - size // 2))
    code, err = finish(p)
    assert code == RESTART and f"{f} was written to while mapped" in err, err[-2000:]


def start_router(model, worker: str, *extra: str):
    p = colibri_popen(["router", "--model", str(model), "--workers", worker, "--port", "0", "--cpu-forms", "off",
                       *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline()
    if not line.startswith("ready "):
        _, err = p.communicate(timeout=30)
        raise RuntimeError(f"the router did not start: {err[-2000:]}")
    return p, line.split()[1]


@pytest.mark.parametrize("change, flags", [("truncated", ()), ("overwritten", ()),
                                           ("truncated", ("--routing-aware-batching",))],
                         ids=["truncated", "overwritten", "truncated-routing-aware"])
def test_a_checkpoint_changed_under_the_routers_mapped_weights_is_named_and_the_router_stops_for_a_restart(
        model, change, flags):
    """Routing-aware batching reads the embedding on the caller's thread at admission (its hint): guarded too."""
    worker, waddr = start_worker(model, "--experts-in-place", "off")     # its experts packed: only the router maps
    try:
        router, addr = start_router(model, waddr, *flags)
        (f,) = model.glob("*.safetensors")
        with Client(addr) as client:
            before = client.generate([1, 2, 3], max_tokens=4).token_ids
            assert len(before) == 4
            size = f.stat().st_size
            with open(f, "r+b") as out:
                if change == "truncated":
                    out.truncate(size // 2)                                      # half of it gone under the map
                else:
                    out.seek(size // 2)
                    out.write(b"\xff" * (size - size // 2))
            with pytest.raises(GenerationError) as exc:
                for _ in range(100):                     # the next step sees it (or the watch, between steps)
                    client.generate([1, 2, 3], max_tokens=4)
                    time.sleep(0.05)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value.details()
        assert exc.value.retryable or "not serving" in exc.value.details().lower()
        code, err = finish(router)
        why = "changed size while mapped" if change == "truncated" else "was written to while mapped"
        assert code == RESTART and f"{f} {why}" in err, f"exit {code} (a SIGBUS is -7): {err[-2000:]}"
        assert "embed and lm_head in place (mapped" in err
    finally:
        worker.kill()
        worker.communicate()


def test_with_weights_in_place_off_the_router_copies_them_and_a_changed_file_does_not_stop_it(model):
    worker, waddr = start_worker(model, "--experts-in-place", "off")
    try:
        router, addr = start_router(model, waddr, "--weights-in-place", "off")
        (f,) = model.glob("*.safetensors")
        with Client(addr) as client:
            before = client.generate([1, 2, 3], max_tokens=4).token_ids
            with open(f, "r+b") as out:                  # the router's own bytes are copies: it does not care
                out.seek(f.stat().st_size - 8)
                out.write(b"\x00" * 8)
            time.sleep(0.5)                              # past the watch's interval, had there been one
            assert client.generate([1, 2, 3], max_tokens=4).token_ids == before
        router.terminate()
        code, err = finish(router)
        assert code == 0 and "in place (mapped" not in err, err[-2000:]
    finally:
        worker.kill()
        worker.communicate()


def test_the_in_process_engine_copies_its_weights_unless_asked(model):
    """Nothing restarts an in-process engine whose checkpoint changed under its mapping: it copies the embedding
    and lm_head by default, and maps them only when asked."""
    from colibri.llm import LLM

    with LLM(model, workers=0, cpu_forms="off") as llm:
        assert llm._built[0].mapped is None
    with LLM(model, workers=0, cpu_forms="off", weights_in_place="auto") as llm:
        assert llm._built[0].mapped is not None


SIGBUS_SCRIPT = """
import mmap, os, sys
import torch
from kernels import native
assert native.exit_on_sigbus(75)
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(os.urandom(1 << 20))
m = mmap.mmap(os.open(path, os.O_RDONLY), 0, access=mmap.ACCESS_READ)
t = torch.frombuffer(m, dtype=torch.uint8)
os.truncate(path, 4096)                  # what a copy over the file, mid-read, does to the pages past it
print(int(t[-1]))                        # a read of a page that is gone: SIGBUS
"""


@pytest.mark.skipif(not __import__("kernels").native.available(), reason="the SIGBUS handler is a native op")
def test_a_read_that_faults_on_a_changed_file_names_it_and_exits_75(tmp_path):
    """The services check a mapped file before each read, but a change that lands during one still faults: the
    process exits 75 naming the file (serve restarts it on the new file), not -7 without a word."""
    import sys

    target = tmp_path / "model.safetensors"
    out = subprocess.run([sys.executable, "-c", SIGBUS_SCRIPT, str(target)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == RESTART, f"exit {out.returncode} (a SIGBUS is -7): {out.stderr[-2000:]}"
    assert f"colibri: SIGBUS reading {target} through its mapping: the file was truncated" in out.stderr
    sent = subprocess.run([sys.executable, "-c", "import os, signal; from kernels import native; "
                           "native.exit_on_sigbus(75); os.kill(os.getpid(), signal.SIGBUS)"], capture_output=True,
                          timeout=120)
    assert sent.returncode == -7 and b"colibri: SIGBUS" not in sent.stderr   # a kill -BUS is not ours: default


def test_a_restart_after_a_change_waits_for_the_copy_to_end(tmp_path):
    """`serve` restarts a service that exited 75 once its checkpoint files stop changing: restarted mid-copy, the
    service found a partial file, failed its start, and the fleet stopped with it."""
    import threading

    from colibri_common.file_watch import files_settled

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    done = threading.Event()

    def copy() -> None:                          # a slow copy over the file: 1.5 s of growth
        with open(f, "ab") as out:
            for _ in range(15):
                out.write(b"y" * 4096)
                out.flush()
                time.sleep(0.1)
        done.set()

    said: list[str] = []
    threading.Thread(target=copy, daemon=True).start()
    t0 = time.monotonic()
    assert files_settled(tmp_path, threading.Event(), quiet_s=0.4, say=said.append)
    assert done.is_set() and time.monotonic() - t0 >= 1.4 and len(said) == 1 and "are changing" in said[0]
    stop = threading.Event()
    stop.set()
    assert not files_settled(tmp_path, stop, quiet_s=0.2)             # serve is stopping: no wait


def test_the_in_process_decode_plan_checks_the_mapped_experts_before_each_step(model):
    """A decode step takes every layer's experts at once (ExpertShard.native_layers, for the model's decode plan),
    with one check of the mapped files for them all: a truncated file is named there, before any read."""
    from colibri_common.file_watch import MappingChanged
    from tests.inprocess import InProcess

    with InProcess(model, cpu_forms="off") as engine:
        shard = engine.shard
        assert shard.in_place
        h = torch.zeros(1, engine.built.cfg.hidden_size, dtype=shard.dtype)       # [T, H]
        plans = shard.native_layers(h)
        assert plans is shard.native_layers(h) and any(p is not None for p in plans)
        files = sorted(model.glob("*.safetensors"))
        with open(files[0], "r+b") as f:
            f.truncate(files[0].stat().st_size // 2)
        with pytest.raises(MappingChanged, match="changed size while mapped"):
            shard.native_layers(h)
