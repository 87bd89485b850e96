"""The Helm chart, rendered with real Helm (helm-python-sdk) and validated against Kubernetes 1.30 schemas."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import re
import shutil
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from colibri.cli import build_parser, command_options

CHART = Path(__file__).resolve().parent.parent / "charts" / "colibri"
K8S = "1.30.0"
VALUE_SETS = {
    "defaults": {},
    "tls": {"tls": {"enabled": True, "existingSecret": "colibri-tls", "clientAuth": True},
            "networkPolicy": {"enabled": True}},
    "plain": {"tls": {"enabled": False}, "networkPolicy": {"enabled": False}},
    "cert-manager": {"tls": {"certManager": {"enabled": True}}, "openai": {"enabled": True}},
    "cert-manager-issuer": {"tls": {"certManager": {"enabled": True, "issuerRef": {
        "name": "corp-ca", "kind": "ClusterIssuer"}}, "extraDnsNames": ["moe.example.com"]}},
    "network-peers": {"router": {"networkPolicy": {"from": [
                          {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}},
                          {"podSelector": {"matchLabels": {"role": "client"}}}]}},
                      "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "monitoring"}}}]},
                      "openai": {"enabled": True, "apiKey": {"existingSecret": "front-key", "secretKey": "key"}}},
    "gpu": {"router": {"gpus": 1}, "experts": {"gpus": 1, "shards": 4}},
    "pvc": {"model": {"source": "pvc", "pvc": {"claimName": "qwen3-30b", "subPath": "Qwen3-30B-A3B"}}},
    "hostPath": {"model": {"source": "hostPath", "hostPath": {"path": "/data/models/mixtral"}}},
    "init": {"model": {"source": "init", "init": {"source": "s3://bucket/olmoe", "image": "amazon/aws-cli:2.17.0",
                                                  "command": ["aws", "s3", "sync", "$(MODEL_SOURCE)",
                                                              "$(MODEL_DIR)"]}}},
    "hpa": {"router": {"autoscaling": {"enabled": True, "maxReplicas": 6}}, "serviceMonitor": {"enabled": True}},
    "one-shard": {"experts": {"shards": 1}},
    "int8": {"model": {"quantize": "int8"}},
    "w8a8-batch-invariant": {"model": {"quantize": "w8a8", "batchInvariant": True}},
    "eight-shards": {"experts": {"shards": 8, "spreadAcrossNodes": False}},
    "expert-cache": {"experts": {"cache": {"capacity": "25%", "policy": "lfu", "hostCapacity": "8GiB"}},
                     "router": {"expertPrefetch": True, "routingAwareBatching": True}},
    "openai": {"openai": {"enabled": True, "servedModelName": "qwen3-moe", "autoscaling": {"enabled": True},
                          "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "spot", "operator": "Exists"}],
                          "networkPolicy": {"from": [{"namespaceSelector": {"matchLabels": {
                              "kubernetes.io/metadata.name": "ingress"}}}]}},
               "serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": True}},
    "openai-tls": {"openai": {"enabled": True, "service": {"type": "LoadBalancer"}},
                   "tls": {"enabled": True, "existingSecret": "colibri-tls", "clientAuth": True},
                   "networkPolicy": {"enabled": True}},
    # elastic expert parallelism: the workers start empty, the router places the experts and follows the pods
    "elastic": {"experts": {"placement": "router", "autoscaling": {"enabled": True}, "redundantExperts": 2}},
    "elastic-tls": {"experts": {"placement": "router", "shards": 3, "replicas": 2, "maxExperts": 48,
                                "rebalanceInterval": 300, "placementWindow": 512, "terminationGracePeriodSeconds": 90},
                    "tls": {"enabled": True, "clientAuth": True}, "networkPolicy": {"enabled": True},
                    "openai": {"enabled": True}},
    "elastic-plain": {"experts": {"placement": "router"}, "tls": {"enabled": False},
                      "fleetToken": {"existingSecret": "corp-fleet", "secretKey": "fleet"}},
    "keda": {"router": {"keda": {"enabled": True}}, "serviceMonitor": {"enabled": True}},
    # the Kubernetes values passed through as they are, in the shapes the schema checks
    "scheduling": {"imagePullSecrets": [{"name": "regcred"}],
                   "router": {"nodeSelector": {"node.kubernetes.io/instance-type": "c7a.4xlarge"},
                              "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm",
                                               "effect": "NoSchedule"}],
                              "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                                  "nodeSelectorTerms": [{"matchExpressions": [{
                                      "key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}}},
                   "experts": {"tolerations": [{"operator": "Exists", "effect": "NoExecute",
                                                "tolerationSeconds": 300}]},
                   "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    # whole numbers from a million up: Helm holds them as float64 and printed 2e+06, which the CLI and Kubernetes refuse
    "large-numbers": {"router": {"maxNumTokens": 2_000_000, "maxWaiting": 1_000_000, "kvCacheMb": 1_000_000},
                      "experts": {"maxExperts": 1_000_000}, "terminationGracePeriodSeconds": 1_000_000},
}


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(CHART)
    manifests = chart.render(values, name="prod", namespace="llm", is_install=True)
    docs = []
    for path, text in manifests.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def api_key_secrets(docs: list[dict]) -> list[dict]:
    """The OpenAI front's API key Secret(s) the chart makes (the fleet token's is Opaque too)."""
    return [s for s in by_kind(docs, "Secret") if s["type"] == "Opaque" and s["metadata"]["name"].endswith("-api-key")]


def fleet_secrets(docs: list[dict]) -> list[dict]:
    return [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-fleet-token")]


def elastic(values: dict) -> bool:
    return values.get("experts", {}).get("placement") == "router"


def of(docs: list[dict], kind: str, component: str) -> list[dict]:
    """The objects of one kind that belong to one component (router, experts, openai)."""
    return [d for d in by_kind(docs, kind)
            if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_strict(name):
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, kube_version=f"v{K8S}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_manifest_validates_against_kubernetes(name):
    validate(render(VALUE_SETS[name]))


def validate(docs: list[dict]) -> None:
    """Every object against Kubernetes' schemas (strict), the custom resources by the fields Colibri sets."""
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            assert doc["kind"] == "ServiceMonitor" and doc["spec"]["endpoints"][0]["port"] in ("metrics", "http")
            continue
        if doc["apiVersion"] == "cert-manager.io/v1":                 # CRDs kubernetes-validate does not know
            assert doc["kind"] in ("Issuer", "Certificate") and doc["spec"]
            continue
        if doc["apiVersion"] == "keda.sh/v1alpha1":
            assert doc["kind"] == "ScaledObject" and doc["spec"]["scaleTargetRef"]["kind"] == "Deployment"
            assert doc["spec"]["triggers"][0]["type"] == "prometheus"
            continue
        kubernetes_validate.validate(doc, K8S, strict=True)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_wiring(name):
    values = VALUE_SETS[name]
    docs = render(values)
    shards = values.get("experts", {}).get("shards", 2)
    (sts,) = by_kind(docs, "StatefulSet")
    (dep,) = of(docs, "Deployment", "router")
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    router = dep["spec"]["template"]["spec"]["containers"][0]
    expert = sts["spec"]["template"]["spec"]["containers"][0]
    eport = next(p["containerPort"] for p in expert["ports"] if p["name"] == "grpc")
    name = sts["metadata"]["name"]
    env = {e["name"]: e for e in expert["env"]}
    if elastic(values):
        # the router follows the headless Service (one address per pod); the pods start with no shard
        assert sts["spec"].get("replicas") == (None if values["experts"].get("autoscaling", {}).get("enabled")
                                               else shards)
        assert f"--follow-workers={headless['metadata']['name']}.llm.svc.cluster.local:{eport}" in router["args"]
        assert not [a for a in router["args"] if a.startswith("--workers=")]
        assert not [a for a in expert["args"] if a.startswith(("--shard", "--replicas"))] and "SHARD_INDEX" not in env
    else:
        assert sts["spec"]["replicas"] == shards
        # the router's worker list is exactly the StatefulSet's pods' stable DNS names
        workers = next(a for a in router["args"] if a.startswith("--workers=")).split("=", 1)[1].split(",")
        assert workers == [f"{name}-{i}.{headless['metadata']['name']}.llm.svc.cluster.local:{eport}"
                           for i in range(shards)]

        # every expert pod learns its shard from its ordinal, and the shard count matches the replicas
        shard_arg = next(a for a in expert["args"] if a.startswith("--shard="))
        assert shard_arg == f"--shard=$(SHARD_INDEX)/{shards}"
        assert env["SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']"
    # router and workers share the fleet token
    for container in (router, expert):
        assert "secretKeyRef" in {e["name"]: e for e in container["env"]}["COLIBRI_FLEET_TOKEN"]["valueFrom"]

    # selectors match pod labels; services select the right pods
    for workload in (dep, sts):
        sel = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items()
    (router_svc,) = of(docs, "Service", "router")
    assert router_svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = next(p for p in router_svc["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["appProtocol"] == "grpc"
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        assert any(pdb["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
                   for w in (dep, sts, *of(docs, "Deployment", "openai")))

    # every flag the chart passes is one the CLI knows, with a value its option dataclass accepts
    for container in (router, expert):
        argv = [a.replace("$(SHARD_INDEX)", "0") for a in container["args"]]
        ap = build_parser()
        opts = command_options(ap, ap.parse_args(argv))
        assert opts.model == "/models/model"
        assert opts.quantize == (values.get("model", {}).get("quantize") or None)   # router and workers agree
        assert opts.batch_invariant == values.get("model", {}).get("batchInvariant", False)

    # probes are native gRPC probes on the ports the containers expose; readiness names the service
    for container, service in ((router, "colibri.v1.Generation"), (expert, "colibri.v1.ExpertWorker")):
        ports = {p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if "grpc" in container[probe]:
                port, named = container[probe]["grpc"]["port"], container[probe]["grpc"].get("service", "")
            else:                                          # over TLS: `colibri health`, parsed by our own CLI
                cmd = container[probe]["exec"]["command"]
                assert cmd[0] == "colibri"
                health = command_options(ap, ap.parse_args(cmd[1:]))
                port, named = int(health.target.rsplit(":", 1)[1]), health.service
            assert port in ports
            # liveness asks for the process alone; so does the router's startup, whose readiness waits for the
            # workers (they start apart, on other nodes: a router killed for their slowness would reload for nothing)
            alone = probe == "livenessProbe" or (probe == "startupProbe" and container is router)
            assert named == ("" if alone else service)
            assert container[probe]["timeoutSeconds"] >= 5             # kubelet's 1 s: a busy Python process misses it
        assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 300
        # --threads 0 would leave torch its default, the node's cores: the container's CPU request instead
        threads = next(a for a in container["args"] if a.startswith("--threads="))
        cpu = str(container["resources"].get("requests", {}).get("cpu", ""))
        want = -(-int(cpu[:-1]) // 1000) if cpu.endswith("m") else -(-float(cpu) // 1) if cpu else 0
        assert threads == f"--threads={int(want)}", (threads, cpu)
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True and mounts["dshm"]["mountPath"] == "/dev/shm"
    # the router is Available only once the workers have loaded: a rollout's deadline past the startup budget
    budget = expert["startupProbe"]["failureThreshold"] * expert["startupProbe"]["periodSeconds"]
    assert dep["spec"]["progressDeadlineSeconds"] > budget
    for workload in (dep, sts):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["terminationGracePeriodSeconds"] > 5          # the services take up to 5 s to stop
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"


def test_value_specific_rendering():
    gpu = render(VALUE_SETS["gpu"])
    for w in by_kind(gpu, "Deployment") + by_kind(gpu, "StatefulSet"):
        container = w["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "--device=cuda" in container["args"]                  # the pod computes on the GPU it requests
    assert "nvidia.com/gpu" not in str(render({})) and "--device" not in str(render({}))

    pvc = by_kind(render(VALUE_SETS["pvc"]), "StatefulSet")[0]["spec"]["template"]["spec"]
    assert pvc["volumes"][0]["persistentVolumeClaim"] == {"claimName": "qwen3-30b", "readOnly": True}
    host = by_kind(render(VALUE_SETS["hostPath"]), "Deployment")[0]["spec"]["template"]["spec"]
    assert host["volumes"][0]["hostPath"]["path"] == "/data/models/mixtral"
    init = by_kind(render(VALUE_SETS["init"]), "StatefulSet")[0]["spec"]["template"]["spec"]
    (fetch,) = init["initContainers"]
    assert fetch["image"] == "amazon/aws-cli:2.17.0" and "emptyDir" in init["volumes"][0]
    assert not [m for m in fetch["volumeMounts"] if m["name"] == "model" and m.get("readOnly")]

    hpa_docs = render(VALUE_SETS["hpa"])
    (hpa,) = by_kind(hpa_docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["maxReplicas"] == 6
    assert "replicas" not in by_kind(hpa_docs, "Deployment")[0]["spec"]      # the HPA owns it
    assert by_kind(hpa_docs, "ServiceMonitor")
    assert not by_kind(render({}), "HorizontalPodAutoscaler")

    spread = by_kind(render({}), "StatefulSet")[0]["spec"]["template"]["spec"]["affinity"]
    assert spread["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"][
        "topologyKey"] == "kubernetes.io/hostname"


def test_large_whole_numbers_render_as_digits():
    docs = render(VALUE_SETS["large-numbers"])
    router = of(docs, "Deployment", "router")[0]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert {"--max-num-tokens=2000000", "--max-waiting=1000000", "--kv-cache-mb=1000000"} <= set(args), args
    assert router["terminationGracePeriodSeconds"] == 1_000_000
    workers = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-step-tokens=2000000" in workers, workers
    assert "e+" not in str(docs)


def test_helm_test_pod_checks_router_health():
    docs = render({})
    (pod,) = [d for d in by_kind(docs, "Pod") if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    args = pod["spec"]["containers"][0]["args"]
    assert args[0] == "health" and "--service=colibri.v1.Generation" in args
    (router_svc,) = of(docs, "Service", "router")
    assert re.match(rf"--target={router_svc['metadata']['name']}\.llm\.svc\.cluster\.local:50051$", args[1])


@pytest.mark.parametrize("bad", [
    {"experts": {"shards": "two"}},
    {"experts": {"shards": 0}},
    {"model": {"source": "nfs"}},
    {"router": {"port": 70000}},
    {"router": {"gpus": -1}},
    {"model": {"dtype": "int4"}},
    {"model": {"quantize": "int4"}},
    {"terminationGracePeriodSeconds": 2},
    {"routr": {}},
    {"model": {"quantize": "int8"}, "experts": {"gpus": 1}},     # int8 experts are the CPU path
    {"model": {"quantize": "w8a8"}, "experts": {"gpus": 1}},
    {"model": {"batchInvariant": True}, "router": {"gpus": 1}},  # batch invariance is the CPU path
    {"model": {"batchInvariant": "yes"}},
    {"experts": {"shards": 2, "replicas": 3}},                    # more replicas than pods
    {"experts": {"replicas": 0}},
    {"experts": {"cache": {"capacity": "lots"}}},
    {"experts": {"cache": {"policy": "fifo"}}},
    {"openai": {"replicas": -1}},
    {"openai": {"replicas": 0}},
    {"openai": {"port": "x"}},
    {"openai": {"port": 0}},
    {"openai": {"port": 65536}},
    {"openai": {"enabled": "yes"}},
    {"openai": {"servedModelName": 7}},
    {"openai": {"extraArgs": "--foo"}},
    {"openai": {"service": {"type": "Ingress"}}},
    {"openai": {"autoscaling": {"maxReplicas": 0}}},
    {"openai": {"pdb": {"maxUnavailable": 0}}},
    {"openai": {"networkPolicy": {"from": "everyone"}}},
    {"openai": {"replica": 2}},                                   # a typo is refused, not ignored
    {"tls": {"validityDays": 0}},
    {"tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "Secret"}}}},
    {"tls": {"certManager": {"duration": "1 year"}}},
    {"tls": {"extraDnsNames": "moe.example.com"}},
    {"tls": {"extraDnsNames": ["moe.example.com:443"]}},        # a port: had been taken for an IP (a raw template
    {"tls": {"extraDnsNames": ["300.1.1.1"]}},                  # error, or an invalid ipAddresses entry)
    {"clusterDomain": "cluster.local."},                         # a trailing dot: names in the certificate with it
    {"clusterDomain": " "},                                      # --workers=...svc. :50061, which the router refuses
    {"tls": {"existingSecret": "a", "certManager": {"enabled": True}}},   # two sources for one Secret
    {"networkPolicy": {"metricsFrom": "monitoring"}},
    {"router": {"networkPolicy": {"from": [{"namespaceSelector": {}}], "to": []}}},
    {"openai": {"apiKey": {"secretKey": ""}}},
    {"openai": {"apiKey": {"enabled": "yes"}}},
])
def test_schema_rejects_wrong_values(bad):
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmError):
        chart.render(bad, name="prod", namespace="llm", is_install=True)


def test_a_value_set_to_null_is_refused_by_the_schema_or_renders_valid_objects():
    """`--set router=null` (Helm's way to drop a default) gave raw template errors ("nil pointer evaluating
    interface {}.port"); every value the chart's defaults set is now required where its templates need it, and
    where null is a user's way to drop a Kubernetes field (a securityContext entry, a resource limit) the objects
    still validate."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    paths: list[tuple[str, ...]] = []

    def walk(node: dict, at: tuple[str, ...]) -> None:
        for key, value in node.items():
            if value is not None:
                paths.append((*at, key))
            if isinstance(value, dict):
                walk(value, (*at, key))

    walk(defaults, ())
    refused, seen = 0, set()
    for path in paths:
        for base in ({}, {"openai": {"enabled": True}}):
            values = json.loads(json.dumps(base))
            node = values
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = None
            try:
                docs = render(values)
            except helm.HelmError as exc:
                assert "don't meet the specifications of the schema" in str(exc), (path, str(exc)[-400:])
                refused += 1
                continue
            fresh = [d for d in docs if json.dumps(d, sort_keys=True) not in seen]
            validate(fresh) if fresh else None
            seen.update(json.dumps(d, sort_keys=True) for d in fresh)
    assert refused > 100     # the sections and their settings; the rest rendered and validated


@pytest.mark.parametrize(("entry", "field"), [
    (e, "allowedHosts") for e in ("*", "*.example.com", "api.example.com", "API.Example.COM.", "10.0.0.5",
                                  "10.0.0.5:8000", "[::1]", "[::1]:8000", "::1", "fe80::1", "my_host", " a.example ",
                                  "*.*", "a..b", "x:abc", "é.com", "http://x/y", "*.", ".a", "a b", "", "[::1",
                                  "a,b", "*.example.com:80", "[::1]:x")] + [
    (e, "allowedOrigins") for e in ("*", "https://app.example.com", "HTTP://LOCALHOST:3000/", "http://[::1]:8080",
                                    " https://a.example ", "https://a.example/path", "ftp://x", "https://a,b",
                                    "null", "https://é.com", "https://a.example:123456", "https://", "")])
def test_the_schema_takes_the_hosts_and_origins_the_front_takes(entry, field):
    """The schema took entries `colibri openai` refuses ('*.*', 'a..b', 'é.com'): a front that crash-looped."""
    from colibri.openai_api.policy import host_entry, origin_entry

    try:
        (host_entry if field == "allowedHosts" else origin_entry)(entry)
        cli_takes = True
    except ValueError:
        cli_takes = False
    try:
        render({"openai": {"enabled": True, field: [entry]}})
        chart_takes = True
    except helm.HelmError as exc:
        assert f"/openai/{field}/0" in str(exc)
        chart_takes = False
    assert chart_takes == cli_takes


def test_the_generated_certificates_last_at_most_a_century():
    """Helm's clock wraps past about 106,751 days (int64 nanoseconds): 200000 days gave certificates that had
    already expired."""
    with pytest.raises(helm.HelmError, match="(?s)at '/tls/validityDays'.*maximum"):
        render({"tls": {"validityDays": 200000}})
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pems(tls_secret(render({"tls": {"validityDays": 36500}})))["tls.crt"])
    assert cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=36499)


def test_notes_render():
    notes = helm.Chart.load(CHART).render({}, name="prod", namespace="llm", is_install=True)
    text = next(v for k, v in notes.items() if k.endswith("NOTES.txt"))
    assert "prod-colibri-router.llm.svc.cluster.local:50051" in text and "grpcurl" in text
    # one pod an expert (the default): a restart, an eviction or an upgrade leaves experts without a worker, said
    assert "Each expert is on one pod (experts.replicas=1)" in text and "set experts.replicas=2" in text
    notes = helm.Chart.load(CHART).render({"experts": {"shards": 3, "replicas": 2}}, name="prod", namespace="llm",
                                          is_install=True)
    assert "Each expert is on one pod" not in next(v for k, v in notes.items() if k.endswith("NOTES.txt"))


def test_the_validator_is_not_a_no_op():
    dep = by_kind(render({}), "Deployment")[0]
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S, strict=True)


def test_the_expert_cache_settings_reach_the_workers_and_the_router():
    docs = render(VALUE_SETS["expert-cache"])
    worker = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    router = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    want = {"--expert-cache-capacity=25%", "--expert-cache-policy=lfu", "--expert-cache-host-capacity=8GiB"}
    assert want <= set(worker)
    assert {"--expert-prefetch", "--routing-aware-batching"} <= set(router)
    plain = render({})
    assert "--expert-cache-capacity=all" in by_kind(plain, "StatefulSet")[0]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--expert-prefetch" not in str(plain)


def test_replicas_reach_every_worker():
    (sts,) = by_kind(render({"experts": {"shards": 4, "replicas": 2}}), "StatefulSet")
    assert "--replicas=2" in sts["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_router_drains_within_the_pods_grace_period():
    for grace in (35, 120):
        dep = by_kind(render({"terminationGracePeriodSeconds": grace}), "Deployment")[0]["spec"]["template"]["spec"]
        assert dep["terminationGracePeriodSeconds"] == grace
        assert f"--grace-period={grace - 5}" in dep["containers"][0]["args"]


def test_service_monitors_scrape_the_router_and_every_worker():
    docs = render(VALUE_SETS["hpa"])
    monitors = by_kind(docs, "ServiceMonitor")
    services = by_kind(docs, "Service")
    scraped = set()
    for mon in monitors:
        want = mon["spec"]["selector"]["matchLabels"]
        (svc,) = [s for s in services if want.items() <= s["metadata"]["labels"].items()]
        assert "metrics" in [p["name"] for p in svc["spec"]["ports"]]
        scraped.add(svc["metadata"]["labels"]["app.kubernetes.io/component"])
    assert scraped == {"router", "experts"}
    for w in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
        c = w["spec"]["template"]["spec"]["containers"][0]
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        assert f"--metrics-port={port}" in c["args"]


def test_tls_mounts_the_secret_passes_the_flags_and_probes_over_tls():
    docs = render(VALUE_SETS["tls"])
    for w in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert {"--tls-cert=/etc/colibri/tls/tls.crt", "--tls-key=/etc/colibri/tls/tls.key",
                "--tls-ca=/etc/colibri/tls/ca.crt"} <= set(c["args"])
        assert {"name": "tls", "secret": {"secretName": "colibri-tls", "defaultMode": 0o440}} in spec["volumes"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            cmd = c[probe]["exec"]["command"]                    # kubelet's gRPC probes cannot speak TLS
            assert cmd[:2] == ["colibri", "health"] and "--tls-ca=/etc/colibri/tls/ca.crt" in cmd
        assert any(a.startswith("--tls-server-name=") for a in c["readinessProbe"]["exec"]["command"])
    assert "--tls-client-auth" in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert "--tls-ca=/etc/colibri/tls/ca.crt" in pod["spec"]["containers"][0]["args"]
    assert not [d for d in by_kind(docs, "Secret") if d["type"] == "kubernetes.io/tls"]   # the existing one
    assert {"name": "tls", "secret": {"secretName": "colibri-tls", "defaultMode": 0o440}} in pod["spec"]["volumes"]
    assert "checksum/tls" not in str(docs)                    # the chart cannot know what is in someone else's Secret
    (pol,) = of(docs, "NetworkPolicy", "experts")
    grpc_rule, metrics_rule = pol["spec"]["ingress"]
    assert grpc_rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert grpc_rule["ports"] == [{"port": 50061, "protocol": "TCP"}] and "from" not in metrics_rule
    assert pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "experts"
    plain = render(VALUE_SETS["plain"])
    assert not by_kind(plain, "NetworkPolicy") and "grpc" in by_kind(plain, "Deployment")[0]["spec"]["template"][
        "spec"]["containers"][0]["readinessProbe"]


# Secure by default: TLS between router and workers with certificates Helm makes, NetworkPolicies for every
# component, an API key for the HTTP front.

def tls_secret(docs: list[dict]) -> dict:
    (secret,) = [d for d in by_kind(docs, "Secret") if d["type"] == "kubernetes.io/tls"]
    return secret


def pems(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def host_of(arg: str) -> str:
    return arg.split("=", 1)[1].rsplit(":", 1)[0]


def named_by(host: str, sans: list[str]) -> bool:
    """TLS host matching: an exact name, or a wildcard standing for the first label only."""
    return host in sans or any(s.startswith("*.") and host.split(".", 1)[1] == s[2:] for s in sans)


def test_tls_and_network_policies_are_on_by_default():
    docs = render({})
    secret = tls_secret(docs)
    assert secret["metadata"]["name"] == "prod-colibri-tls" and set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    pem = pems(secret)
    assert pem["ca.crt"].startswith(b"-----BEGIN CERTIFICATE") and b"PRIVATE KEY" in pem["tls.key"]
    kubernetes_validate.validate(secret, K8S, strict=True)
    checksum = hashlib.sha256(json.dumps(secret["data"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    for w in of(docs, "Deployment", "router") + by_kind(docs, "StatefulSet"):
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert {"--tls-cert=/etc/colibri/tls/tls.crt", "--tls-key=/etc/colibri/tls/tls.key",
                "--tls-ca=/etc/colibri/tls/ca.crt"} <= set(c["args"])
        assert {"name": "tls", "secret": {"secretName": "prod-colibri-tls", "defaultMode": 0o440}} in spec["volumes"]
        assert {"name": "tls", "mountPath": "/etc/colibri/tls", "readOnly": True} in c["volumeMounts"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["exec"]["command"][:2] == ["colibri", "health"] and c[probe]["timeoutSeconds"] > 5
        # new certificates restart router and workers together: both sides must trust the same CA
        assert w["spec"]["template"]["metadata"]["annotations"]["checksum/tls"] == checksum
    assert "--tls-client-auth" not in str(of(docs, "Deployment", "router"))
    (pod,) = by_kind(docs, "Pod")
    assert {"name": "tls", "secret": {"secretName": "prod-colibri-tls", "defaultMode": 0o440}} in pod["spec"]["volumes"]

    (workers,) = of(docs, "NetworkPolicy", "experts")
    assert workers["spec"]["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = workers["spec"]["ingress"]
    router_selector = {"app.kubernetes.io/name": "colibri", "app.kubernetes.io/instance": "prod",
                       "app.kubernetes.io/component": "router"}
    assert grpc_rule == {"from": [{"podSelector": {"matchLabels": router_selector}}],
                         "ports": [{"port": 50061, "protocol": "TCP"}]}
    assert metrics_rule == {"ports": [{"port": 9091, "protocol": "TCP"}]}        # metricsFrom [] = any scraper
    (router,) = of(docs, "NetworkPolicy", "router")
    router_pods = of(docs, "Deployment", "router")[0]["spec"]["template"]["metadata"]["labels"]
    assert router["spec"]["podSelector"]["matchLabels"].items() <= router_pods.items()
    grpc_rule, metrics_rule = router["spec"]["ingress"]
    assert grpc_rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    peers = grpc_rule["from"]
    assert peers[0] == {"podSelector": {}}                        # this namespace's pods, not the whole cluster
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers[1:]] == ["test"]
    assert peers[1]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()   # `helm test`
    assert metrics_rule == {"ports": [{"port": 9090, "protocol": "TCP"}]}
    assert not of(docs, "NetworkPolicy", "openai")


def test_the_generated_certificate_names_the_router_and_every_worker():
    from cryptography import x509

    values = {"openai": {"enabled": True}, "experts": {"shards": 3}, "tls": {"extraDnsNames": ["moe.example.com"]}}
    docs = render(values)
    pem = pems(tls_secret(docs))
    ca = x509.load_pem_x509_certificate(pem["ca.crt"])
    cert = x509.load_pem_x509_certificate(pem["tls.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
    life = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=3640) < life <= datetime.timedelta(days=3650)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "moe.example.com" in sans and "*.prod-colibri-experts.llm.svc.cluster.local" in sans

    # every name a TLS client of this release checks: the worker pods the router dials, the names the probes
    # give, the router Service the front and `helm test` dial
    router = of(docs, "Deployment", "router")[0]["spec"]["template"]["spec"]["containers"][0]
    workers = next(a for a in router["args"] if a.startswith("--workers=")).split("=", 1)[1].split(",")
    hosts = [w.rsplit(":", 1)[0] for w in workers]
    assert len(hosts) == 3
    for c in (router, by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]):
        hosts += [a.split("=", 1)[1] for a in c["readinessProbe"]["exec"]["command"] if a.startswith("--tls-server")]
    hosts.append(host_of(next(a for a in front(values)[2]["args"] if a.startswith("--target="))))
    hosts.append(host_of(by_kind(docs, "Pod")[0]["spec"]["containers"][0]["args"][1]))
    assert len(hosts) == 7
    for host in hosts:
        assert named_by(host, sans), host
    assert not named_by("prod-colibri-experts-0.other.llm.svc.cluster.local", sans)


def test_the_generated_certificates_serve_mutual_tls(tmp_path):
    """The PEM files Helm makes, loaded by Colibri's own TLS code: a worker-like server that requires client
    certificates answers the router's names and refuses callers without the certificate."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from colibri.health import HealthOptions, run_health
    from colibri_common.tls import TlsFiles

    for name, data in pems(tls_secret(render({}))).items():
        (tmp_path / name).write_bytes(data)
    ca, cert, key = (str(tmp_path / n) for n in ("ca.crt", "tls.crt", "tls.key"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", TlsFiles.of(cert, key, ca).server(require_client_cert=True))
    server.start()
    try:
        def check(name, **tls):
            return run_health(HealthOptions(target=f"127.0.0.1:{port}", timeout=5, tls_server_name=name, **tls))

        mutual = {"tls_ca": ca, "tls_cert": cert, "tls_key": key}
        assert check("prod-colibri-experts-1.prod-colibri-experts.llm.svc.cluster.local", **mutual) == 0   # router
        assert check("probe.prod-colibri-experts.llm.svc.cluster.local", **mutual) == 0                   # probe
        assert check("prod-colibri-router.llm.svc.cluster.local", **mutual) == 0
        assert check("evil.example", **mutual) == 1                                   # a name it does not carry
        assert check("probe.prod-colibri-experts.llm.svc.cluster.local", tls_ca=ca) == 1   # no client certificate
        assert check(None) == 1                                                            # plaintext
    finally:
        server.stop(0)


def test_without_tls_nothing_of_it_renders():
    for values in ({"tls": {"enabled": False}}, VALUE_SETS["plain"]):
        docs = render({**values, "openai": {"enabled": True}})
        assert {s["type"] for s in by_kind(docs, "Secret")} == {"Opaque"}       # the API key and the fleet token
        text = str([d for d in docs if d["kind"] != "NetworkPolicy"])
        assert "--tls" not in text and "/etc/colibri/tls" not in text and "checksum/tls" not in text
        for w in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
            assert "tls" not in [v["name"] for v in w["spec"]["template"]["spec"]["volumes"]]
        router = of(docs, "Deployment", "router")[0]["spec"]["template"]["spec"]["containers"][0]
        assert router["readinessProbe"]["grpc"] == {"port": 50051, "service": "colibri.v1.Generation"}
    assert of(render({"tls": {"enabled": False}}), "NetworkPolicy", "router")          # the policies stay


def test_an_existing_secret_replaces_the_generated_one():
    docs = render({"tls": {"existingSecret": "corp-tls"}, "openai": {"enabled": True}})
    assert not [d for d in by_kind(docs, "Secret") if d["type"] == "kubernetes.io/tls"]
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io")]
    for w in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet") + by_kind(docs, "Pod"):
        spec = w["spec"]["template"]["spec"] if w["kind"] != "Pod" else w["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert vol["secret"]["secretName"] == "corp-tls"
        assert "--tls-ca=/etc/colibri/tls/ca.crt" in str(spec["containers"][0])
    assert "checksum/tls" not in str(docs)


def test_cert_manager_writes_the_secret():
    docs = render(VALUE_SETS["cert-manager"])
    assert not by_kind(docs, "Secret") or all(s["type"] == "Opaque" for s in by_kind(docs, "Secret"))
    issuers = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "Issuer")}
    certs = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "Certificate")}
    assert issuers == {"prod-colibri-selfsigned": {"selfSigned": {}}, "prod-colibri-ca": {"ca": {"secretName":
                                                                                              "prod-colibri-ca"}}}
    assert certs["prod-colibri-ca"]["isCA"] and certs["prod-colibri-ca"]["secretName"] == "prod-colibri-ca"
    assert certs["prod-colibri-ca"]["issuerRef"]["name"] == "prod-colibri-selfsigned"
    leaf = certs["prod-colibri-tls"]
    assert leaf["secretName"] == "prod-colibri-tls" and leaf["issuerRef"]["name"] == "prod-colibri-ca"
    assert {"server auth", "client auth"} <= set(leaf["usages"])
    assert "*.prod-colibri-experts.llm.svc.cluster.local" in leaf["dnsNames"]
    assert "prod-colibri-router.llm.svc.cluster.local" in leaf["dnsNames"]
    for w in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
        (vol,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
        assert vol["secret"]["secretName"] == "prod-colibri-tls"
    assert "checksum/tls" not in str(docs)

    docs = render(VALUE_SETS["cert-manager-issuer"])
    assert not by_kind(docs, "Issuer")
    (leaf,) = by_kind(docs, "Certificate")
    assert leaf["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}
    assert "moe.example.com" in leaf["spec"]["dnsNames"]


def test_network_policies_follow_their_values():
    docs = render(VALUE_SETS["network-peers"])
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    (router,) = of(docs, "NetworkPolicy", "router")
    grpc_rule, metrics_rule = router["spec"]["ingress"]
    peers = grpc_rule["from"]
    assert peers[:2] == [gateway, {"podSelector": {"matchLabels": {"role": "client"}}}]
    # the chart's own front and test pod stay admitted however narrow the list
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers[2:]] == ["openai", "test"]
    front_pods = of(docs, "Deployment", "openai")[0]["spec"]["template"]["metadata"]["labels"]
    assert peers[2]["podSelector"]["matchLabels"].items() <= front_pods.items()
    assert metrics_rule["from"] == monitoring
    (workers,) = of(docs, "NetworkPolicy", "experts")
    assert workers["spec"]["ingress"][1]["from"] == monitoring
    assert workers["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == \
        "router"                                                     # the workers admit nobody else on gRPC
    (anyone,) = of(render({"router": {"networkPolicy": {"from": []}}}), "NetworkPolicy", "router")
    assert "from" not in anyone["spec"]["ingress"][0]                # [] = any client
    assert not by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def render_upgrade(tmp_path: Path, values: dict, cluster: dict[str, dict]) -> list[dict]:
    """Render as `helm upgrade` does with `cluster`'s Secrets present: a copy of the chart whose Secret lookups
    read them from files (helm-python-sdk renders offline, where lookup finds nothing)."""
    chart = tmp_path / "colibri"
    if not chart.exists():
        shutil.copytree(CHART, chart)
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    (chart / "cluster").mkdir(exist_ok=True)
    for name in ("tlsSecretName", "apiKeySecretName", "fleetTokenSecretName"):
        call = f'lookup "v1" "Secret" .Release.Namespace (include "colibri.{name}" .)'
        assert text.count(call) == 1
        text = text.replace(call, f'(.Files.Get "cluster/{name}.json" | fromJson)')
        (chart / "cluster" / f"{name}.json").write_text(json.dumps(cluster.get(name, {})))
    (chart / "templates" / "_helpers.tpl").write_text(text)
    manifests = helm.Chart.load(chart).render(values, name="prod", namespace="llm", is_upgrade=True)
    return [d for path, t in manifests.items() if not path.endswith(".txt") for d in yaml.safe_load_all(t) if d]


def test_upgrades_keep_the_generated_secrets(tmp_path):
    values = {"openai": {"enabled": True}}
    first = render(values)
    tls = tls_secret(first)
    (key,) = api_key_secrets(first)
    (fleet,) = fleet_secrets(first)
    annotations = lambda docs: [w["spec"]["template"]["metadata"]["annotations"]    # noqa: E731
                                for w in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")]

    cluster = {"tlsSecretName": tls, "apiKeySecretName": key, "fleetTokenSecretName": fleet}
    again = render_upgrade(tmp_path, values, cluster)
    assert tls_secret(again)["data"] == tls["data"]
    assert api_key_secrets(again)[0]["data"] == key["data"]
    assert fleet_secrets(again)[0]["data"] == fleet["data"]
    assert annotations(again) == annotations(first)                     # no pod restarts

    # names changed (another cluster domain): a certificate for the new names, and every pod restarts
    moved = render_upgrade(tmp_path, {**values, "clusterDomain": "corp.internal"}, cluster)
    assert pems(tls_secret(moved))["tls.crt"] != pems(tls)["tls.crt"]
    assert all(a["checksum/tls"] != b["checksum/tls"]
               for a, b in zip(annotations(moved), annotations(first), strict=True))
    # a Secret that lost an entry is made anew, not half-reused
    broken = {**tls, "data": {k: v for k, v in tls["data"].items() if k != "tls.key"}}
    assert set(tls_secret(render_upgrade(tmp_path, values, {"tlsSecretName": broken}))["data"]) == {
        "ca.crt", "tls.crt", "tls.key"}
    # a fresh install makes new ones
    assert tls_secret(render(values))["data"] != tls["data"]


def test_the_front_gets_an_api_key_from_a_secret():
    docs, dep, c = front({"openai": {"enabled": True}})
    (secret,) = api_key_secrets(docs)
    kubernetes_validate.validate(secret, K8S, strict=True)
    assert secret["metadata"]["name"] == "prod-colibri-openai-api-key"
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert len(key) == 48 and key.isalnum()
    env = {e["name"]: e for e in c["env"]}
    assert env["COLIBRI_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "prod-colibri-openai-api-key",
                                                                    "key": "api-key"}}
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/api-key"] == hashlib.sha256(
        json.dumps(secret["data"], separators=(",", ":")).encode()).hexdigest()
    assert "checksum/api-key" not in str(of(docs, "Deployment", "router"))
    assert key not in str([d for d in docs if d["kind"] != "Secret"])

    docs, dep, c = front(VALUE_SETS["network-peers"])                   # openai.apiKey.existingSecret=front-key
    assert not api_key_secrets(docs)
    assert {e["name"]: e for e in c["env"]}["COLIBRI_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "front-key", "key": "key"}
    assert "checksum/api-key" not in str(dep)

    docs, dep, c = front({"openai": {"enabled": True, "apiKey": {"enabled": False}}})
    assert "COLIBRI_API_KEY" not in str(c) and not api_key_secrets(docs)
    assert not api_key_secrets(render({}))                                              # no front, no key


# The OpenAI-compatible HTTP front (`colibri openai`), off unless openai.enabled.

def front(values: dict) -> tuple[list[dict], dict, dict]:
    """The documents, the front's Deployment and its container."""
    docs = render(values)
    (dep,) = of(docs, "Deployment", "openai")
    return docs, dep, dep["spec"]["template"]["spec"]["containers"][0]


def test_the_openai_front_is_off_by_default():
    everything_on = {"serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": True}}
    for values in ({}, everything_on, {**everything_on, "openai": {"autoscaling": {"enabled": True}}}):
        docs = render(values)
        assert [d["metadata"]["name"] for d in docs if "openai" in d["metadata"]["name"]] == []
        assert "openai" not in str([d for d in docs if d["kind"] != "Pod"])
        assert not of(docs, "HorizontalPodAutoscaler", "openai")
    notes = helm.Chart.load(CHART).render({}, name="prod", namespace="llm", is_install=True)
    assert "/v1/chat/completions" not in next(v for k, v in notes.items() if k.endswith("NOTES.txt"))


def test_the_openai_front_dials_the_router_service_and_serves_its_port():
    docs, dep, c = front({"openai": {"enabled": True}})
    for doc in of(docs, "Deployment", "openai") + of(docs, "Service", "openai"):
        kubernetes_validate.validate(doc, K8S, strict=True)
    (router_svc,) = of(docs, "Service", "router")
    grpc = next(p["port"] for p in router_svc["spec"]["ports"] if p["name"] == "grpc")
    target = f"{router_svc['metadata']['name']}.llm.svc.cluster.local:{grpc}"
    front_svc = "prod-colibri-openai"
    hosts = f"{front_svc},{front_svc}.llm,{front_svc}.llm.svc,{front_svc}.llm.svc.cluster.local,$(POD_IP),localhost," \
            "127.0.0.1"
    assert c["args"] == ["openai", f"--target={target}", "--host=0.0.0.0", "--port=8000", f"--allowed-hosts={hosts}",
                         "--generation-config=auto", "--tls-ca=/etc/colibri/tls/ca.crt",   # TLS is on by default
                         "--log-level=INFO",
                         "--grace-period=25"]       # terminationGracePeriodSeconds, less the preStop's 5 and 5 to exit
    # deleted, it accepts on while its endpoint's removal spreads (SIGTERM closes its listening socket)
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    c0 = front({"openai": {"enabled": True, "preStopSleepSeconds": 0}})[2]
    assert "lifecycle" not in c0 and "--grace-period=30" in c0["args"]
    with pytest.raises(helm.HelmError, match="leaves the front no drain"):      # SIGKILL would cut the drain
        render({"openai": {"enabled": True, "preStopSleepSeconds": 30}})
    # the Host names it answers: its Service's, and its pod's IP, which kubelet's probes and scrapers call
    assert {e["name"]: e for e in c["env"]}["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert dep["spec"]["replicas"] == 1

    # one named port, reached by the Service, the readiness probe (/health) and the liveness probe
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["tcpSocket"] == {"port": "http"}      # a router outage unreadies, never restarts
    assert "httpGet" not in c["livenessProbe"] and "startupProbe" not in c
    (svc,) = of(docs, "Service", "openai")
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                     "appProtocol": "http"}]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    router_pods = of(docs, "Deployment", "router")[0]["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= router_pods.items()
    assert not router_svc["spec"]["selector"].items() <= pod_labels.items()

    # the router's pod conventions; no model, no /dev/shm, no Kubernetes API token
    spec = dep["spec"]["template"]["spec"]
    router_spec = of(docs, "Deployment", "router")[0]["spec"]["template"]["spec"]
    assert spec["securityContext"] == router_spec["securityContext"]
    assert c["securityContext"] == router_spec["containers"][0]["securityContext"]
    assert c["image"] == router_spec["containers"][0]["image"]
    assert spec["automountServiceAccountToken"] is False
    assert {v["name"] for v in spec["volumes"]} == {"tmp", "tls"}
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"},
                                 {"name": "tls", "mountPath": "/etc/colibri/tls", "readOnly": True}]
    assert {"name": "HOME", "value": "/tmp"} in c["env"]
    assert c["resources"]["requests"]["cpu"] and "nvidia.com/gpu" not in str(c["resources"])


def test_the_openai_front_follows_its_values():
    docs, dep, c = front({"openai": {"enabled": True, "port": 9000, "replicas": 3, "servedModelName": "org/qwen3: moe",
                                     "extraArgs": ["--max-tokens-default", "256"], "service": {"type": "NodePort"},
                                     "allowedHosts": ["api.example.com"], "allowedOrigins": ["https://a.example",
                                                                                             "https://b.example"],
                                     "generationConfig": "vllm"},
                          "router": {"port": 50052}, "logLevel": "DEBUG", "clusterDomain": "corp"})
    svc = "prod-colibri-openai"
    assert c["args"] == ["openai", "--target=prod-colibri-router.llm.svc.corp:50052", "--host=0.0.0.0",
                         "--port=9000", "--served-model-name=org/qwen3: moe",
                         f"--allowed-hosts={svc},{svc}.llm,{svc}.llm.svc,{svc}.llm.svc.corp,$(POD_IP),localhost,"
                         "127.0.0.1,api.example.com", "--allowed-origins=https://a.example,https://b.example",
                         "--generation-config=vllm", "--tls-ca=/etc/colibri/tls/ca.crt", "--log-level=DEBUG",
                         "--grace-period=25", "--max-tokens-default", "256"]
    assert c["ports"][0]["containerPort"] == 9000 and dep["spec"]["replicas"] == 3
    (svc,) = of(docs, "Service", "openai")
    assert svc["spec"]["type"] == "NodePort" and svc["spec"]["ports"][0]["port"] == 9000

    docs, dep, c = front(VALUE_SETS["openai"])
    spec = dep["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "cpu"} and spec["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert "--served-model-name=qwen3-moe" in c["args"]
    (hpa,) = of(docs, "HorizontalPodAutoscaler", "openai")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert "replicas" not in dep["spec"]                                  # the HPA owns it
    assert "replicas" in of(docs, "Deployment", "router")[0]["spec"]     # ... the router's own stays
    (pdb,) = of(docs, "PodDisruptionBudget", "openai")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert not of(render({"openai": {"enabled": True, "pdb": {"enabled": False}}}), "PodDisruptionBudget", "openai")


def test_the_openai_fronts_flags_are_ones_the_cli_knows():
    from colibri.cli import COMMANDS

    if "openai" not in COMMANDS:
        pytest.skip("`colibri openai` is not in the CLI yet")
    for values in (VALUE_SETS["openai"], VALUE_SETS["openai-tls"]):
        ap = build_parser()
        argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in front(values)[2]["args"]]   # kubelet expands it
        opts = command_options(ap, ap.parse_args(argv))
        assert opts.target == "prod-colibri-router.llm.svc.cluster.local:50051" and opts.port == 8000
        assert {"prod-colibri-openai.llm.svc.cluster.local", "10.1.2.3", "localhost"} <= set(opts.allowed_hosts)
    ap = build_parser()
    argv = front({"openai": {"enabled": True, "allowedHosts": ["api.example.com", "*.corp.example"],
                             "allowedOrigins": ["https://app.example.com"]}})[2]["args"]
    opts = command_options(ap, ap.parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in argv]))
    assert {"api.example.com", "*.corp.example", "prod-colibri-openai"} <= set(opts.allowed_hosts)
    assert opts.allowed_origins == ("https://app.example.com",)


def test_the_service_monitor_scrapes_the_fronts_metrics():
    docs, dep, c = front(VALUE_SETS["openai"])
    (mon,) = [m for m in by_kind(docs, "ServiceMonitor") if m["metadata"]["name"] == dep["metadata"]["name"]]
    (svc,) = [s for s in by_kind(docs, "Service")
              if mon["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == "openai"
    (endpoint,) = mon["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "prod-colibri-openai-api-key",
                                                                           "key": "api-key"}}  # only /health is open
    (mon,) = [m for m in by_kind(render({**VALUE_SETS["openai"], "openai": {"enabled": True, "apiKey": {
        "enabled": False}}}), "ServiceMonitor") if m["metadata"]["name"] == dep["metadata"]["name"]]
    assert "authorization" not in mon["spec"]["endpoints"][0]
    assert len(by_kind(docs, "ServiceMonitor")) == 3
    assert not [m for m in by_kind(render({"openai": {"enabled": True}}), "ServiceMonitor")]


def test_network_policies_let_clients_reach_the_front_and_the_front_reach_the_router():
    docs, dep, c = front(VALUE_SETS["openai"])
    front_pods = dep["spec"]["template"]["metadata"]["labels"]
    router_dep = of(docs, "Deployment", "router")[0]
    router_pods = router_dep["spec"]["template"]["metadata"]["labels"]
    router_port = next(p["containerPort"] for p in router_dep["spec"]["template"]["spec"]["containers"][0]["ports"]
                       if p["name"] == "grpc")
    policies = by_kind(docs, "NetworkPolicy")
    (pol,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= front_pods.items()]
    (rule,) = pol["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}]
    (anyone,) = of(render({"openai": {"enabled": True}, "networkPolicy": {"enabled": True}}), "NetworkPolicy", "openai")
    assert "from" not in anyone["spec"]["ingress"][0]                     # [] = any client
    # every policy that selects the router admits the front on the router's gRPC port
    for p in policies:
        if p["spec"]["podSelector"]["matchLabels"].items() <= router_pods.items():
            assert any(r.get("from") is None or any(
                peer.get("podSelector", {}).get("matchLabels", {}).items() <= front_pods.items() for peer in r["from"])
                for r in p["spec"]["ingress"] if router_port in [x["port"] for x in r.get("ports", [])])
    # the workers' policy still admits only the router
    (experts_pol,) = [p for p in policies if p["metadata"]["name"].endswith("-experts")]
    assert experts_pol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "router"
    assert of(docs, "NetworkPolicy", "router")
    assert not by_kind(render({"openai": {"enabled": True}, "networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_the_openai_front_dials_the_router_over_tls():
    docs, dep, c = front(VALUE_SETS["openai-tls"])                        # the router requires client certificates
    assert {"--tls-ca=/etc/colibri/tls/ca.crt", "--tls-cert=/etc/colibri/tls/tls.crt",
            "--tls-key=/etc/colibri/tls/tls.key"} <= set(c["args"])
    assert next(a for a in c["args"] if a.startswith("--target=")).split("=", 1)[1].startswith(
        "prod-colibri-router.llm.svc.cluster.local:")                       # the name the router's certificate carries
    spec = dep["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "colibri-tls", "defaultMode": 0o440}} in spec["volumes"]
    assert {"name": "tls", "mountPath": "/etc/colibri/tls", "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"             # its own HTTP port stays plain
    (svc,) = of(docs, "Service", "openai")
    assert svc["spec"]["type"] == "LoadBalancer"

    # without client auth: the CA alone, and only the CA from the Secret is mounted
    docs, dep, c = front({"openai": {"enabled": True}, "tls": {"enabled": True, "existingSecret": "colibri-tls"}})
    tls_args = [a for a in c["args"] if a.startswith("--tls")]
    assert tls_args == ["--tls-ca=/etc/colibri/tls/ca.crt"]
    (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert vol["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    kubernetes_validate.validate(dep, K8S, strict=True)
    with pytest.raises(helm.HelmError, match="tls.secretName is now tls.existingSecret"):
        render({"openai": {"enabled": True}, "tls": {"enabled": True, "secretName": "colibri-tls"}})
    assert "--tls" not in str(front({"openai": {"enabled": True}, "tls": {"enabled": False}})[2])


@pytest.mark.parametrize(("bad", "where"), [
    ({"replicas": -1}, "/openai/replicas"),
    ({"port": "x"}, "/openai/port"),
    ({"port": 70000}, "/openai/port"),
    ({"servedModelName": ["a"]}, "/openai/servedModelName"),
    ({"generationConfig": "hf"}, "/openai/generationConfig"),
    ({"service": {"type": "Ingress"}}, "/openai/service/type"),
])
def test_the_schema_names_the_wrong_openai_value(bad, where):
    with pytest.raises(helm.HelmError, match=f"(?s)schema.*at '{where}'"):
        helm.Chart.load(CHART).render({"openai": {"enabled": True, **bad}}, name="prod", namespace="llm",
                                      is_install=True)


def test_notes_say_how_to_reach_the_front():
    def notes(values):
        out = helm.Chart.load(CHART).render(values, name="prod", namespace="llm", is_install=True)
        return next(v for k, v in out.items() if k.endswith("NOTES.txt"))

    text = notes({"openai": {"enabled": True, "servedModelName": "qwen3-moe"}})
    assert "http://prod-colibri-openai.llm.svc.cluster.local:8000/v1" in text
    assert "port-forward svc/prod-colibri-openai 8000" in text and "localhost:8000/v1/chat/completions" in text
    assert '"model": "qwen3-moe"' in text
    assert "EXTERNAL-IP" in notes({"openai": {"enabled": True, "service": {"type": "LoadBalancer"}}})


# Elastic expert parallelism (experts.placement=router): the workers start empty, the router places the experts,
# follows the headless Service and re-plans live; a stopping pod's preStop hook moves its experts away first.

def pods(docs: list[dict]) -> tuple[dict, dict, dict, dict]:
    """The router Deployment, the experts StatefulSet and their containers."""
    (dep,) = of(docs, "Deployment", "router")
    (sts,) = by_kind(docs, "StatefulSet")
    return dep, sts, dep["spec"]["template"]["spec"]["containers"][0], sts["spec"]["template"]["spec"]["containers"][0]


def parse(argv: list[str]):
    ap = build_parser()
    return command_options(ap, ap.parse_args(argv))


def test_router_placement_starts_empty_workers_and_the_router_follows_the_headless_service():
    docs = render(VALUE_SETS["elastic-tls"])
    dep, sts, router, expert = pods(docs)
    assert not [a for a in expert["args"] if a.startswith(("--shard", "--replicas"))]
    assert "SHARD_INDEX" not in str(expert["env"])
    worker = parse(expert["args"])
    assert not worker.shard and worker.max_experts == 48                 # no shard: the router assigns them
    assert sts["spec"]["replicas"] == 3                                      # experts.shards: the starting size

    opts = parse(router["args"])                                             # the real CLI accepts the chart's flags
    (headless,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert opts.follow_workers == "prod-colibri-experts.llm.svc.cluster.local:50061"
    assert opts.follow_workers.split(".")[0] == headless["metadata"]["name"] and opts.workers == ()
    assert (opts.expert_replicas, opts.redundant_experts, opts.rebalance_interval, opts.placement_window) == \
        (2, 0, 300.0, 512)
    # one placement owner: one router, replaced (not rolled) on upgrades
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 35
    assert not by_kind(docs, "HorizontalPodAutoscaler")

    opts = parse(pods(render(VALUE_SETS["elastic"]))[2]["args"])
    assert (opts.expert_replicas, opts.redundant_experts, opts.rebalance_interval, opts.placement_window) == \
        (1, 2, 0.0, 256)

    # static placement (the default) keeps today's wiring
    dep, sts, router, expert = pods(render({}))
    assert "--follow-workers" not in str(router["args"]) and "--expert-replicas" not in str(router["args"])
    assert "--max-experts" not in str(expert["args"]) and "lifecycle" not in expert
    # the strategy is the chart's in both placements (Kubernetes' defaults here), so that switching placement on an
    # existing release removes rollingUpdate rather than leave it beside Recreate, which the API refuses
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%",
                                                                                  "maxUnavailable": "25%"}}
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 35


def test_the_experts_autoscale_only_with_router_placement():
    docs = render(VALUE_SETS["elastic"])
    dep, sts, router, expert = pods(docs)
    assert "replicas" not in sts["spec"]                                     # the HPA owns it
    (hpa,) = of(docs, "HorizontalPodAutoscaler", "experts")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": sts["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 80
    # scale-down one pod per grace period: the router takes one change at a time (a second `colibri workers
    # remove` while one runs is refused), and each pod's preStop hook needs its grace period to move its experts
    assert hpa["spec"]["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]}]
    assert dep["spec"]["replicas"] == 1 and not of(docs, "HorizontalPodAutoscaler", "router")


def prestop_argv(expert: dict, tmp_path: Path, pod: str) -> list[str]:
    """Run the expert container's preStop hook in a real shell, with `colibri` a stand-in that prints its argv."""
    import subprocess
    import sys

    fake = tmp_path / "colibri"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    fake.chmod(0o755)
    cmd = expert["lifecycle"]["preStop"]["exec"]["command"]
    env_names = {e["name"] for e in expert["env"]}
    assert "POD_NAME" in env_names and "COLIBRI_FLEET_TOKEN" in env_names       # the hook sees the container's env
    out = subprocess.run(cmd, env={"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_NAME": pod}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", ["elastic", "elastic-tls", "elastic-plain"])
def test_the_prestop_hook_asks_the_router_to_move_the_pods_experts_away(name, tmp_path):
    values = VALUE_SETS[name]
    docs = render(values)
    dep, sts, router, expert = pods(docs)
    env = {e["name"]: e for e in expert["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    argv = prestop_argv(expert, tmp_path, "prod-colibri-experts-1")
    assert argv[0] == "workers"
    opts = parse(argv)                                                       # a `colibri workers` command line
    assert opts.action == "remove"
    # the name the router knows the pod by: its stable DNS name under the headless Service it follows
    follow = parse(router["args"]).follow_workers
    assert opts.addresses == (f"prod-colibri-experts-1.{follow}",)
    (svc,) = of(docs, "Service", "router")
    assert opts.target == f"{svc['metadata']['name']}.llm.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert opts.timeout == grace - 10 and grace == values["experts"].get("terminationGracePeriodSeconds", 120)
    if values.get("tls", {}).get("enabled", True):
        mounted = {m["mountPath"] for m in expert["volumeMounts"]}
        assert "/etc/colibri/tls" in mounted
        assert (opts.tls_ca, opts.tls_cert, opts.tls_key) == ("/etc/colibri/tls/ca.crt", "/etc/colibri/tls/tls.crt",
                                                              "/etc/colibri/tls/tls.key")
        assert opts.tls_server_name is None                                  # the target is a name the cert carries
    else:
        assert (opts.tls_ca, opts.tls_cert, opts.tls_key) == (None, None, None)


def test_the_prestop_hook_names_hosts_the_generated_certificate_carries(tmp_path):
    from cryptography import x509

    docs = render(VALUE_SETS["elastic-tls"])
    cert = x509.load_pem_x509_certificate(pems(tls_secret(docs))["tls.crt"])
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    opts = parse(prestop_argv(pods(docs)[3], tmp_path, "prod-colibri-experts-2"))
    assert named_by(opts.target.rsplit(":", 1)[0], sans)                    # the hook checks the router's name
    assert named_by(opts.addresses[0].rsplit(":", 1)[0], sans)              # the router dials the pod by this name


def test_the_fleet_token_secret_reaches_the_router_and_the_workers(monkeypatch):
    from colibri_common.fleet_token import ENV, fleet_token

    assert ENV == "COLIBRI_FLEET_TOKEN"
    for values in ({}, VALUE_SETS["elastic"], {"openai": {"enabled": True}}):
        docs = render(values)
        (secret,) = fleet_secrets(docs)
        kubernetes_validate.validate(secret, K8S, strict=True)
        assert secret["metadata"]["name"] == "prod-colibri-fleet-token" and secret["type"] == "Opaque"
        token = base64.b64decode(secret["data"]["token"]).decode()
        monkeypatch.setenv(ENV, token)
        assert fleet_token() == token and len(token) >= 32                # what every Colibri process accepts
        checksum = hashlib.sha256(json.dumps(secret["data"], separators=(",", ":")).encode()).hexdigest()
        dep, sts, router, expert = pods(docs)
        for workload, c in ((dep, router), (sts, expert)):
            assert {e["name"]: e for e in c["env"]}[ENV]["valueFrom"] == {"secretKeyRef": {
                "name": "prod-colibri-fleet-token", "key": "token"}}
            # a new token restarts router and workers together: both sides must hold the same one
            assert workload["spec"]["template"]["metadata"]["annotations"]["checksum/fleet-token"] == checksum
        assert token not in str([d for d in docs if d["kind"] != "Secret"])
        for front_dep in of(docs, "Deployment", "openai"):                 # the front calls Generation: no token
            assert ENV not in str(front_dep) and "checksum/fleet-token" not in str(front_dep)
    assert fleet_secrets(render({}))[0]["data"] != fleet_secrets(render({}))[0]["data"]      # random per install

    docs = render(VALUE_SETS["elastic-plain"])                              # fleetToken.existingSecret
    assert not fleet_secrets(docs) and not [s for s in by_kind(docs, "Secret") if "corp-fleet" in str(s)]
    for c in pods(docs)[2:]:
        assert {e["name"]: e for e in c["env"]}["COLIBRI_FLEET_TOKEN"]["valueFrom"] == {"secretKeyRef": {
            "name": "corp-fleet", "key": "fleet"}}
    assert "checksum/fleet-token" not in str(docs)


def test_upgrades_keep_the_fleet_token(tmp_path):
    values = VALUE_SETS["elastic"]
    first = render(values)
    (fleet,) = fleet_secrets(first)
    again = render_upgrade(tmp_path, values, {"fleetTokenSecretName": fleet})
    assert fleet_secrets(again)[0]["data"] == fleet["data"]
    annotations = [w["spec"]["template"]["metadata"]["annotations"]["checksum/fleet-token"] for w in pods(again)[:2]]
    assert annotations == [w["spec"]["template"]["metadata"]["annotations"]["checksum/fleet-token"]
                           for w in pods(first)[:2]]                       # no restarts
    # a Secret without the entry (another fleetToken.secretKey) gets a new token
    renamed = render_upgrade(tmp_path, {**values, "fleetToken": {"secretKey": "fleet"}},
                             {"fleetTokenSecretName": fleet})
    assert set(fleet_secrets(renamed)[0]["data"]) == {"fleet"}


@pytest.mark.parametrize(("values", "message"), [
    ({"experts": {"placement": "router"}, "router": {"replicas": 2}}, "placement has one owner"),
    ({"experts": {"placement": "router"}, "router": {"autoscaling": {"enabled": True}}}, "placement has one owner"),
    ({"experts": {"placement": "router"}, "router": {"keda": {"enabled": True}}}, "placement has one owner"),
    ({"experts": {"autoscaling": {"enabled": True}}}, "experts.autoscaling needs experts.placement=router"),
    ({"experts": {"placement": "static", "autoscaling": {"enabled": True}}}, "needs experts.placement=router"),
    ({"router": {"keda": {"enabled": True}, "autoscaling": {"enabled": True}}},
     "router.keda and router.autoscaling both scale the router"),
    ({"experts": {"placement": "router", "replicas": 3}}, "experts.replicas must be at most experts.shards"),
    ({"experts": {"placement": "router", "replicas": 3, "shards": 4, "autoscaling": {"enabled": True}}},
     "experts.replicas must be at most experts.autoscaling.minReplicas"),
])
def test_placement_and_scaling_conflicts_fail_with_a_reason(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_keda_scales_the_router_on_the_requests_waiting():
    from router_service.engine.metrics import GAUGE_HELP

    docs = render(VALUE_SETS["keda"])
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    (dep,) = of(docs, "Deployment", "router")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                "name": dep["metadata"]["name"]}
    assert "replicas" not in dep["spec"]                                     # KEDA owns it
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 4)
    assert (scaled["spec"]["pollingInterval"], scaled["spec"]["cooldownPeriod"]) == (15, 300)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta == {"serverAddress": "http://prometheus-operated.monitoring.svc:9090",
                    "query": 'sum(colibri:num_requests_waiting{namespace="llm",service="prod-colibri-router"})',
                    "threshold": "4"}
    # this release's routers alone (the ServiceMonitor's targets carry their Service's name): another release in the
    # namespace does not scale this one
    (svc,) = of(docs, "Service", "router")
    assert svc["metadata"]["name"] == "prod-colibri-router" and svc["metadata"]["name"] == dep["metadata"]["name"]
    assert "num_requests_waiting" in GAUGE_HELP                              # a gauge the router exports
    assert not by_kind(docs, "HorizontalPodAutoscaler")
    assert any(m["metadata"]["name"] == dep["metadata"]["name"] for m in by_kind(docs, "ServiceMonitor"))

    docs = render({"router": {"keda": {"enabled": True, "threshold": 10, "serverAddress": "http://prom:9090",
                                       "minReplicaCount": 2, "maxReplicaCount": 6}}})
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "10"  # KEDA wants a string
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 6)
    for values in ({}, VALUE_SETS["elastic"], VALUE_SETS["hpa"]):
        assert not [d for d in render(values) if d["kind"] == "ScaledObject"]


def test_with_router_placement_the_router_admits_the_workers_preStop_calls():
    docs = render(VALUE_SETS["elastic-tls"])
    dep, sts, router, expert = pods(docs)
    worker_pods = sts["spec"]["template"]["metadata"]["labels"]
    (pol,) = of(docs, "NetworkPolicy", "router")
    grpc_rule = pol["spec"]["ingress"][0]
    assert grpc_rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    components = [p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                  for p in grpc_rule["from"]]
    assert components == [None, "openai", "test", "experts"]
    assert grpc_rule["from"][-1]["podSelector"]["matchLabels"].items() <= worker_pods.items()
    (workers,) = of(docs, "NetworkPolicy", "experts")                       # the workers still admit the router only
    assert workers["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "router"
    (static,) = of(render({"networkPolicy": {"enabled": True}}), "NetworkPolicy", "router")
    assert "experts" not in str(static["spec"]["ingress"][0])


@pytest.mark.parametrize("bad", [
    {"experts": {"placement": "dynamic"}},
    {"experts": {"maxExperts": -1}},
    {"experts": {"redundantExperts": -1}},
    {"experts": {"rebalanceInterval": -5}},
    {"experts": {"placementWindow": 0}},
    {"experts": {"terminationGracePeriodSeconds": 10}},                    # no time left for the preStop hook
    {"experts": {"autoscaling": {"minReplicas": 0}}},
    {"experts": {"autoscaling": {"enable": True}}},
    {"router": {"keda": {"minReplicaCount": 0}}},                          # no router, no waiting requests to wake it
    {"router": {"keda": {"serverAddress": ""}}},
    {"router": {"keda": {"threshold": "many"}}},
    {"router": {"keda": {"query": "up"}}},
    {"fleetToken": {"secretKey": ""}},
    {"fleetToken": {"token": "abc"}},
])
def test_schema_rejects_wrong_elastic_values(bad):
    with pytest.raises(helm.HelmError, match="schema"):
        helm.Chart.load(CHART).render(bad, name="prod", namespace="llm", is_install=True)


def test_notes_say_how_to_reach_the_admin_service_and_resize():
    def notes(values):
        out = helm.Chart.load(CHART).render(values, name="prod", namespace="llm", is_install=True)
        return next(v for k, v in out.items() if k.endswith("NOTES.txt"))

    text = notes(VALUE_SETS["elastic-tls"])
    assert "kubectl -n llm exec deploy/prod-colibri-router -- colibri workers --target 127.0.0.1:50051" in text
    assert "--tls-server-name prod-colibri-router.llm.svc.cluster.local show" in text
    assert "get secret prod-colibri-fleet-token -o jsonpath='{.data.token}'" in text
    assert "kubectl -n llm scale statefulset/prod-colibri-experts --replicas=N" in text
    assert "placed by the router" in text and "the workers (their preStop hook)" in text
    assert "2-8 (autoscaled)" in notes(VALUE_SETS["elastic"])
    static = notes(VALUE_SETS["plain"])
    assert "colibri workers --target 127.0.0.1:50051 show" in static and "statefulset" not in static
    assert "jsonpath='{.data.fleet}'" in notes(VALUE_SETS["elastic-plain"]) and "corp-fleet" in notes(
        VALUE_SETS["elastic-plain"])


@pytest.mark.parametrize(("values", "message"), [
    ({"model": {"quantize": "int8"}, "router": {"gpus": 1}}, "router.gpus=1 puts the router on a GPU"),
    ({"router": {"port": 9090}}, "router.port and router.metricsPort are both 9090"),
    ({"experts": {"metricsPort": 50061}}, "experts.port and experts.metricsPort are both 50061"),
    ({"router": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "router.autoscaling.minReplicas (5) is more than router.autoscaling.maxReplicas (2)"),
    ({"router": {"keda": {"enabled": True, "minReplicaCount": 3, "maxReplicaCount": 2}}},
     "router.keda.minReplicaCount (3) is more than"),
    ({"model": {"source": "init", "init": {"source": " "}}}, "model.source=init: set model.init.source"),
    ({"router": {"extraArgs": ["--port=6000"]}}, "router.extraArgs sets --port, which the chart sets itself"),
    ({"experts": {"extraArgs": ["--shard", "0/1"]}}, "experts.extraArgs sets --shard"),
    ({"openai": {"enabled": True, "extraArgs": ["--target=elsewhere:1"]}}, "openai.extraArgs sets --target"),
    ({"model": {"mountPath": "/tmp"}}, "model.mountPath /tmp overlaps the pods' scratch volume at /tmp"),
    ({"tls": {"mountPath": "/models/model/tls"}}, "overlaps tls.mountPath /models/model/tls at /models/model/tls"),
    ({"tls": {"mountPath": "/tmp"}}, "the pods' scratch volume overlaps tls.mountPath /tmp at /tmp"),  # two mounts
    ({"tls": {"mountPath": "/dev/shm/tls"}}, "shm overlaps tls.mountPath /dev/shm/tls at /dev/shm/tls"),
    ({"model": {"mountPath": "/"}}, "model.mountPath / overlaps the pods' scratch volume at /tmp"),  # over the root
    ({"podSecurityContext": {"runAsUser": 0}}, "runAsUser 0 (root) with runAsNonRoot: true"),
    ({"securityContext": {"runAsUser": 0}}, "runAsUser 0 (root) with runAsNonRoot: true"),
])
def test_values_that_conflict_fail_the_render_naming_them(values, message):
    """Each rendered before: a router the CLI refuses, two ports in one Service, an HPA the API server refuses, an
    init container copying from nothing, a router listening where no probe or Service looks."""
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize(("values", "where"), [
    ({"experts": {"cache": {"capacity": "150%"}}}, "/experts/cache/capacity"),
    ({"experts": {"cache": {"capacity": "0%"}}}, "/experts/cache/capacity"),
    ({"experts": {"cache": {"hostCapacity": "0GiB"}}}, "/experts/cache/hostCapacity"),
    ({"router": {"resources": {"requests": {"cpu": "two"}}}}, "/router/resources/requests/cpu"),
    ({"experts": {"resources": {"limits": {"memory": "16GB"}}}}, "/experts/resources/limits/memory"),
    ({"shm": {"sizeLimit": "huge"}}, "/shm/sizeLimit"),
    ({"shm": {"size": "8Gi"}}, "/shm"),
    ({"openai": {"enabled": True, "allowedOrigins": ["example.com"]}}, "/openai/allowedOrigins/0"),
    ({"openai": {"enabled": True, "allowedHosts": ["https://example.com"]}}, "/openai/allowedHosts/0"),
    ({"router": {"keda": {"enabled": True, "threshold": "0"}}}, "/router/keda/threshold"),
    ({"tls": {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer"}}}}, "/tls/certManager/issuerRef"),
    ({"model": {"source": "pvc", "pvc": {"claimName": "c", "subPath": "/abs"}}}, "/model/pvc/subPath"),
    ({"model": {"source": "pvc", "pvc": {"claimName": "c", "subPath": "a/../b"}}}, "/model/pvc/subPath"),
    ({"experts": {"shards": 2000}}, "/experts/shards"),             # its --workers= would pass Linux's 128 KiB
    ({"podLabels": {"team": "a b"}}, "/podLabels/team"),
    ({"podLabels": {"app.kubernetes.io/component": "x"}}, ""),       # the selector's own labels
    ({"podAnnotations": {"a": 5}}, "/podAnnotations/a"),             # rendered `a: 5`, which the API server refuses
    # names the API server, the kubelet or the operator refuse at install (they rendered)
    ({"image": {"tag": "1.0 rc"}}, "/image/tag"),                    # the kubelet cannot pull it
    ({"image": {"repository": "GHCR.io/Org/Colibri"}}, "/image/repository"),
    ({"model": {"source": "pvc", "pvc": {"claimName": "Models"}}}, "/model/pvc/claimName"),
    ({"model": {"source": "init", "init": {"source": "s3://b/m", "image": "a b"}}}, "/model/init/image"),
    ({"openai": {"enabled": True, "apiKey": {"existingSecret": "My_Key"}}}, "/openai/apiKey/existingSecret"),
    ({"fleetToken": {"existingSecret": "Fleet"}}, "/fleetToken/existingSecret"),
    ({"fleetToken": {"secretKey": "a key"}}, "/fleetToken/secretKey"),
    ({"tls": {"existingSecret": "tls_secret"}}, "/tls/existingSecret"),
    ({"tls": {"certManager": {"enabled": True, "issuerRef": {"name": "My Issuer", "kind": "Issuer"}}}},
     "/tls/certManager/issuerRef/name"),
    ({"serviceMonitor": {"enabled": True, "interval": "often"}}, "/serviceMonitor/interval"),
    ({"openai": {"enabled": True, "servedModelName": " qwen"}}, "/openai/servedModelName"),   # the front refuses it
])
def test_the_schema_refuses_values_the_services_or_the_api_server_would(values, where):
    with pytest.raises(helm.HelmError, match=f"(?s)schema.*at '{where}'"):
        render(values)


def test_real_world_image_references_are_taken():
    """The schema's image patterns refuse what no registry takes, not what users write: a digest pin in the tag, a
    registry host in capitals or as an IPv6 address."""
    digest = "sha256:" + "0f" * 32
    for image in ({"repository": "Registry.Example.com/org/colibri", "tag": f"1.2.3@{digest}"},
                  {"repository": "[fd00::1]:5000/colibri", "tag": "v1_2.3-rc1"}):
        (sts,) = by_kind(render({"image": image}), "StatefulSet")
        assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == f"{image['repository']}:{image['tag']}"


def test_long_release_names_keep_the_expert_pods_makeable_and_the_front_drains_in_its_grace():
    """A StatefulSet's pods carry controller-revision-hash: <name>-<10 characters> (63 at most): a release name of
    50 characters made a 58-character StatefulSet whose pods were never created."""
    docs = helm.Chart.load(CHART).render({"openai": {"enabled": True}}, name="a" * 50, namespace="llm",
                                         is_install=True)
    objs = [d for path, text in docs.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]
    (sts,) = by_kind(objs, "StatefulSet")
    assert len(sts["metadata"]["name"]) <= 52 and sts["spec"]["serviceName"] == sts["metadata"]["name"]
    router = next(d for d in by_kind(objs, "Deployment") if d["metadata"]["name"].endswith("-router"))
    worker_addresses = next(a for a in router["spec"]["template"]["spec"]["containers"][0]["args"]
                            if a.startswith("--workers="))
    assert f"{sts['metadata']['name']}-0." in worker_addresses
    front = next(d for d in by_kind(render({"openai": {"enabled": True}, "terminationGracePeriodSeconds": 12}),
                                    "Deployment") if d["metadata"]["name"].endswith("-openai"))
    assert "--grace-period=2" in front["spec"]["template"]["spec"]["containers"][0]["args"]   # 12 - 5 - preStop 5


def test_a_release_name_that_starts_with_a_digit_is_refused():
    with pytest.raises(helm.HelmError, match="release name 1prod starts with a digit"):
        helm.Chart.load(CHART).render({}, name="1prod", namespace="llm", is_install=True)


def test_ip_addresses_in_extra_names_become_ip_sans():
    """tls.extraDnsNames of 10.0.0.1 went into the DNS names, where a client that verifies an IP never looks."""
    import ipaddress

    from cryptography import x509

    extra = ["moe.example.com", "10.0.0.1", "fd00::1"]
    cert = x509.load_pem_x509_certificate(pems(tls_secret(render({"tls": {"extraDnsNames": extra}})))["tls.crt"])
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("10.0.0.1"),
                                                            ipaddress.ip_address("fd00::1")}
    assert "moe.example.com" in sans.get_values_for_type(x509.DNSName)
    assert not any(n[0].isdigit() or ":" in n for n in sans.get_values_for_type(x509.DNSName))
    managed = by_kind(render({"tls": {"certManager": {"enabled": True}, "extraDnsNames": extra}}), "Certificate")[-1]
    assert managed["spec"]["ipAddresses"] == ["10.0.0.1", "fd00::1"] and "10.0.0.1" not in managed["spec"]["dnsNames"]


@pytest.mark.parametrize(("cpu", "threads"), [("1500m", 2), ("0.5", 1), (3, 3), ("250m", 1), ("2", 2)])
def test_threads_0_is_the_cpu_request_rounded_up_and_a_number_given_is_kept(cpu, threads):
    docs = render({"router": {"resources": {"requests": {"cpu": cpu, "memory": "8Gi"}}}, "experts": {"threads": 3}})
    (dep,) = of(docs, "Deployment", "router")
    (sts,) = by_kind(docs, "StatefulSet")
    assert f"--threads={threads}" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--threads=3" in sts["spec"]["template"]["spec"]["containers"][0]["args"]


def test_operability_mends_from_a_probe():
    """What an SRE hit with values the schema takes: drains blocked by PDBs counting waiting pods, the front's
    metrics unreachable through its NetworkPolicy, `helm test` unable to pull from a private registry or to schedule
    on tainted nodes, an HPA with no CPU request to scale on, --threads 0 (every node core) under a CPU limit."""
    docs = render({"openai": {"enabled": True}})
    budgets = by_kind(docs, "PodDisruptionBudget")
    assert len(budgets) == 3 and all(pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow" for pdb in budgets)
    validate(docs)

    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}]
    docs = render({"openai": {"enabled": True, "networkPolicy": {"from": clients}},
                   "networkPolicy": {"metricsFrom": scrapers}})
    front = of(docs, "NetworkPolicy", "openai")[0]["spec"]["ingress"]
    assert [rule["from"] for rule in front] == [clients, scrapers]
    assert all(rule["ports"] == [{"port": 8000, "protocol": "TCP"}] for rule in front)
    validate(docs)

    docs = render({"imagePullSecrets": [{"name": "regcred"}],
                   "router": {"nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "dedicated",
                                                                                  "operator": "Exists"}]}})
    test_pod = [d for d in by_kind(docs, "Pod") if d["metadata"]["name"].endswith("-test-health")][0]["spec"]
    assert test_pod["imagePullSecrets"] == [{"name": "regcred"}] and test_pod["nodeSelector"] == {"pool": "cpu"}
    assert test_pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    validate(docs)

    for values in ({"router": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}},
                   {"openai": {"enabled": True, "autoscaling": {"enabled": True},
                               "resources": {"requests": {"cpu": None}}}}):
        name = next(iter(values))
        with pytest.raises(Exception, match=f"{name}.autoscaling scales on CPU utilisation"):
            render(values)
    render({"router": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None},
                                                                      "limits": {"cpu": "2"}}}})

    docs = render({"router": {"resources": {"requests": {"cpu": None}, "limits": {"cpu": "3"}}}})
    router = pods(docs)[2]
    assert "--threads=3" in router["args"], router["args"]
    render({"podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False}})          # root, said so: renders

    docs = render({"listenHost": "::", "openai": {"enabled": True}})        # an IPv6 single-stack cluster's pods
    hosts = [a for d in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
             for c in d["spec"]["template"]["spec"]["containers"] for a in c["args"] if a.startswith("--host=")]
    assert hosts == ["--host=::"] * 3, hosts
    assert parse(pods(docs)[2]["args"]).host == "::"
    with pytest.raises(helm.HelmError):
        render({"listenHost": "localhost"})

    docs = render({"serviceMonitor": {"enabled": True}, "openai": {"enabled": True}})   # kubectl -l component=...
    monitors = by_kind(docs, "ServiceMonitor")
    assert sorted(m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors) == \
        ["experts", "openai", "router"]
