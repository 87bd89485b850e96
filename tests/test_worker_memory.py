"""Each expert worker's resident memory tracks its shard, not the whole checkpoint (psutil)."""

from __future__ import annotations

import json
import signal
import subprocess

import psutil
import pytest
import torch
from safetensors.torch import save_file

from colibri.client import Client
from colibri_common.pb import admin_pb2
from tests.conftest import colibri_popen, fleet, free_port, metrics
from tests.forkserver import Forked
from tests.models import small_config

H, I, E, L = 512, 768, 32, 8


def peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def window(pool: torch.Tensor, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """A copy of `pool` from a random offset: random-looking weights at memcpy speed (randn of the ≈1 GB of
    experts took 4 s; their values matter to no assertion here, only their bytes)."""
    n = shape[0] * shape[1]
    start = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=g))
    return pool[start:start + n].view(shape).clone()


def write_big_checkpoint(path) -> int:
    """A Qwen3-MoE checkpoint of ≈1.2 GB, written straight to safetensors (random weights)."""
    path.mkdir()
    cfg = small_config("qwen3_moe", hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2,
                       num_hidden_layers=L, head_dim=64, num_attention_heads=8, num_key_value_heads=2)
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    (path / "config.json").write_text(json.dumps(raw))
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2 * H * I, generator=g) * 0.02                  # the experts' values, at random offsets
    t = {"model.embed_tokens.weight": torch.randn(256, H, generator=g) * 0.02,
         "lm_head.weight": torch.randn(256, H, generator=g) * 0.02, "model.norm.weight": torch.ones(H)}
    for layer in range(L):
        p = f"model.layers.{layer}."
        t |= {p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
              p + "self_attn.q_proj.weight": torch.randn(512, H, generator=g) * 0.02,
              p + "self_attn.k_proj.weight": torch.randn(128, H, generator=g) * 0.02,
              p + "self_attn.v_proj.weight": torch.randn(128, H, generator=g) * 0.02,
              p + "self_attn.o_proj.weight": torch.randn(H, 512, generator=g) * 0.02,
              p + "self_attn.q_norm.weight": torch.ones(64), p + "self_attn.k_norm.weight": torch.ones(64),
              p + "mlp.gate.weight": torch.randn(E, H, generator=g) * 0.02}
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t |= {q + name: window(pool, shape, g) for name, shape in
                  (("gate_proj.weight", (I, H)), ("up_proj.weight", (I, H)), ("down_proj.weight", (H, I)))}
    save_file(t, path / "model.safetensors")
    return (path / "model.safetensors").stat().st_size


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big"
    size = write_big_checkpoint(path)
    assert size > 1100 * 2**20
    return path, size


def rss_parts(pid: int) -> dict[str, int]:
    """RssAnon (the process's own memory) and RssFile (mapped file pages it touches, shared with the page cache)."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def test_each_packing_worker_holds_about_its_shard(big):
    path, size = big
    workers = 4
    with fleet(path, workers, ["--experts-in-place", "off"]) as (addr, proc):
        assert len(Client(addr).generate([1, 2, 3, 4], 4).token_ids) == 4   # every worker has computed
        experts = [c for c in psutil.Process(proc.pid).children() if "expert" in " ".join(c.cmdline())]
        assert len(experts) == workers
        for c in experts:
            rss = c.memory_info().rss
            # a quarter of the experts (≈290 MB) plus the interpreter, torch and gRPC (≈230 MB)
            peak = peak_rss(c.pid)
            msg = f"worker RSS {rss / 2**20:.0f} MiB (peak {peak / 2**20:.0f}) vs checkpoint {size / 2**20:.0f} MiB"
            assert rss < 0.6 * size, msg
            assert rss > 0.9 * size / workers, msg   # it really holds its shard
            assert peak < 0.6 * size, msg            # packing releases the mapped pages as it goes


def test_workers_computing_in_place_hold_no_copy_of_their_experts(big):
    """The checkpoint's float32 experts computed where they lie (the default): a worker's own memory is the
    interpreter, torch and gRPC, its experts are the page cache's pages it touched, and two workers on the host
    share those pages instead of holding a copy each."""
    path, size = big
    shard = E * L * 3 * H * I * 4 // 2
    with fleet(path, 2, ["--dtype", "float32"]) as (addr, proc):
        assert len(Client(addr).generate([1, 2, 3, 4], 4).token_ids) == 4
        experts = [c for c in psutil.Process(proc.pid).children() if "expert" in " ".join(c.cmdline())]
        parts = [rss_parts(c.pid) for c in experts]
    msg = f"workers' RssAnon/RssFile {[(p['RssAnon'] >> 20, p['RssFile'] >> 20) for p in parts]} MiB, shard " \
          f"{shard >> 20} MiB"
    for p in parts:
        assert p["RssAnon"] < 0.5 * shard, msg                 # no packed copy (+580 MiB with one)
        assert p["RssFile"] < shard + 200 * 2**20, msg          # at most its shard's pages (and libraries)


def start_expert(path, *extra: str) -> Forked:
    return colibri_popen(["expert", "--model", str(path), "--shard", "0/2", "--port", "0", "--threads", "1",
                          "--dtype", "bfloat16", "--log-level", "WARNING", "--cpu-forms", "off", *extra],
                         stdout=subprocess.PIPE)


def wait_ready(p: Forked) -> None:
    line = p.stdout.readline()
    assert line.startswith("ready "), line


def test_int8_experts_take_about_half_the_memory_of_bf16(big):
    """Half of the 32 experts x 8 layers: 302 MB in bf16, 151 MB (+ 0.5 MB of scales) in int8."""
    path, _ = big
    expert_bytes_bf16 = 16 * L * 3 * H * I * 2
    procs = [start_expert(path), start_expert(path, "--quantize", "int8")]     # both load at once
    try:
        for p in procs:
            wait_ready(p)
        rss = [psutil.Process(p.pid).memory_info().rss for p in procs]
        peaks = [peak_rss(p.pid) for p in procs]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    saved = rss[0] - rss[1]
    msg = f"RSS bf16 {rss[0] / 2**20:.0f} MiB, int8 {rss[1] / 2**20:.0f} MiB (peaks {peaks[0] / 2**20:.0f}, " \
          f"{peaks[1] / 2**20:.0f}); bf16 experts {expert_bytes_bf16 / 2**20:.0f} MiB"
    assert 0.4 * expert_bytes_bf16 < saved < 0.6 * expert_bytes_bf16, msg      # the experts' half is gone
    assert peaks[1] < peaks[0], msg                          # quantising expert by expert: no float shard copy


def test_a_quarter_capacity_cache_holds_under_half_the_memory_of_a_full_one(big):
    """One worker holds all 256 experts (1.15 GiB in float32); at 25% capacity it packs at most 64 of them,
    evicts as the traffic moves and drops the mapped pages it read (its tokens: tests/test_expert_cache.py)."""
    path, _ = big
    mport = free_port()
    prompts = [[1 + i, 7 * i % 250, 3, 4 + i] for i in range(6)]
    with fleet(path, 1, ["--expert-cache-capacity", "25%", "--expert-prefetch", "--routing-aware-batching",
                         "--metrics-port", str(mport)]) as (addr, proc):
        assert all(len(Client(addr).generate(p, 8).token_ids) == 8 for p in prompts)
        worker = next(c for c in psutil.Process(proc.pid).children() if "expert" in " ".join(c.cmdline()))
        rss, peak = worker.memory_info().rss, peak_rss(worker.pid)
        m = metrics(mport + 1)
    shard = m['colibri:expert_cache_resident_bytes{tier="mapped"}']
    hot = m['colibri:expert_cache_resident_bytes{tier="hot"}']
    assert shard == pytest.approx(E * L * 3 * H * I * 4)
    assert 0 < hot <= 0.25 * shard and m["colibri:expert_cache_slots"] == E * L // 4
    assert m["colibri:expert_cache_evictions_total"] > 0 and m["colibri:expert_cache_misses_total"] > 0
    assert m["colibri:expert_cache_prefetch_packed_total"] > 0
    full = shard + (rss - hot)              # the same process with every expert packed instead
    msg = f"worker RSS {rss / 2**20:.0f} MiB (peak {peak / 2**20:.0f}), hot {hot / 2**20:.0f} MiB, " \
          f"shard {shard / 2**20:.0f} MiB"
    assert rss < 0.5 * full, msg
    assert peak < 0.5 * full, msg           # no moment held the shard, packed or mapped


@pytest.mark.parametrize("in_place", ["off", "auto"])
def test_a_worker_a_resize_releases_gives_its_experts_memory_back(big, in_place):
    """Packed (anonymous memory) or in place (mapped pages): after `colibri workers remove` the worker's resident
    memory drops by most of what its experts took."""
    from tests.test_elastic import admin, router, workers_cli
    from tests.test_elastic import worker as elastic_worker

    path, size = big
    extra = ("--experts-in-place", in_place, "--dtype", "float32")
    with elastic_worker(path, *extra) as (a, pa), elastic_worker(path, *extra) as (b, _), \
            router(path, [a, b], "--dtype", "float32") as (r, _):
        assert len(Client(r).generate(list(range(1, 33)), 4, ignore_eos=True, timeout=120).token_ids) == 4
        held = psutil.Process(pa.pid).memory_info().rss
        res = workers_cli(r, "remove", a)
        assert res.returncode == 0, res.stderr
        assert [w.address for w in admin(r).ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=10).workers] == [b]
        after = psutil.Process(pa.pid).memory_info().rss
        touched = size / 2 if in_place == "off" else 0.1 * size      # in place: the pages 32 tokens touched
        assert held - after > 0.7 * touched, f"RSS {held / 2**20:.0f} -> {after / 2**20:.0f} MiB ({rss_parts(pa.pid)})"
