"""/metrics of the router and of every worker, scraped and parsed with `prometheus_client.parser`: the
names vLLM users know (under colibri:), histograms that move, MoE series per worker and per expert."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from colibri.client import Client, GenerationError
from tests.conftest import fleet, metrics_port


def scrape(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def value(family, name: str, **labels: str) -> float:
    return next(s.value for s in family.samples if s.name == name and labels.items() <= s.labels.items())


def test_router_and_worker_metrics_move_with_the_traffic(oracles):
    oracle = oracles["qwen3_moe"]
    port = metrics_port(2)                          # the workers take P + 1 and P + 2
    with fleet(oracle.path, 2, ["--metrics-port", str(port), "--expert-metrics"]) as (addr, _):
        before = scrape(port)
        client = Client(addr)
        for i in range(5):
            assert len(client.generate([i + 1, 2, 3], 6, ignore_eos=True).token_ids) == 6
        m = scrape(port)
        for h in ("colibri:time_to_first_token_seconds", "colibri:inter_token_latency_seconds",
                  "colibri:e2e_request_latency_seconds"):
            assert m[h].type == "histogram"
            moved = value(m[h], h + "_count") - value(before[h], h + "_count")
            assert moved >= (25 if "inter_token" in h else 5), h
        # a finished request's phases and sizes, under vLLM's names: these 5 requests of 3 + 6 tokens
        for h in ("colibri:request_queue_time_seconds", "colibri:request_prefill_time_seconds",
                  "colibri:request_decode_time_seconds", "colibri:request_prompt_tokens",
                  "colibri:request_generation_tokens"):
            assert m[h].type == "histogram" and value(m[h], h + "_count") - value(before[h], h + "_count") == 5, h
        assert value(m["colibri:request_prompt_tokens"], "colibri:request_prompt_tokens_sum") - \
            value(before["colibri:request_prompt_tokens"], "colibri:request_prompt_tokens_sum") == 15
        assert value(m["colibri:request_generation_tokens"], "colibri:request_generation_tokens_sum") - \
            value(before["colibri:request_generation_tokens"], "colibri:request_generation_tokens_sum") == 30
        steps = m["colibri:iteration_tokens_total"]
        assert value(steps, "colibri:iteration_tokens_total_sum") >= 5 * (3 + 5)     # every token the model ran
        assert value(m["colibri:request_success"], "colibri:request_success_total", finished_reason="length") >= 5
        # requests refused at admission are counted by reason (they were in no metric)
        for bad in ({"temperature": -1.0}, {"stop_token_ids": [10**6]}):
            with pytest.raises(GenerationError):
                client.generate([1, 2], 2, **bad)
        refused = scrape(port)["colibri:request_refused"]
        assert value(refused, "colibri:request_refused_total", reason="invalid") == 2
        assert value(refused, "colibri:request_refused_total", reason="duplicate_id") == 0
        assert value(m["colibri:generation_tokens"], "colibri:generation_tokens_total") >= 30
        assert value(m["colibri:prompt_tokens"], "colibri:prompt_tokens_total") >= 15
        assert m["colibri:num_requests_running"].type == "gauge" and "colibri:kv_cache_usage_perc" in m
        assert value(m["process_resident_memory_bytes"], "process_resident_memory_bytes") > 0
        workers = {s.labels["worker"] for s in m["colibri:worker_dispatch_seconds"].samples}
        assert len(workers) == 2
        assert 0 < value(m["colibri:expert_balance"], "colibri:expert_balance") <= 1
        routed = [s for s in m["colibri:moe_tokens_routed"].samples if s.name.endswith("_total")]
        cfg = oracle.model.config
        moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers)
        # every token the model ran (3 prompt + 5 fed back; the 6th is sampled only) x top-k x MoE layers
        assert sum(s.value for s in routed) == 5 * (3 + 6 - 1) * cfg.num_experts_per_tok * moe_layers
        for w in (port + 1, port + 2):
            wm = scrape(w)
            assert value(wm["colibri:expert_compute_seconds"], "colibri:expert_compute_seconds_count") > 0
            assert value(wm["colibri:expert_tokens"], "colibri:expert_tokens_total") > 0
            held = value(wm["colibri:expert_resident_bytes"], "colibri:expert_resident_bytes")      # packed
            in_place = value(wm["colibri:expert_in_place_bytes"], "colibri:expert_in_place_bytes")  # or mapped
            assert (held > 0) != (in_place > 0)
            pages = {s.labels["page"]: s.value for s in wm["colibri:checkpoint_resident_bytes"].samples} \
                if "colibri:checkpoint_resident_bytes" in wm else {}
            if in_place > 0 and Path("/proc/self/smaps").is_file():   # the mapping computed on, by page size
                assert set(pages) == {"2MiB", "4KiB"} and sum(pages.values()) > 0 and min(pages.values()) >= 0
            elif held > 0:                     # all packed (no expert cache here): no mapping served from
                assert not pages
            assert value(wm["colibri:expert_forward"], "colibri:expert_forward_total", code="ok") > 0
            # the process's own families, on every service (memory and restart panels read them)
            assert value(wm["process_resident_memory_bytes"], "process_resident_memory_bytes") > 0
            assert value(wm["process_start_time_seconds"], "process_start_time_seconds") > 0
