#!/usr/bin/env python3
"""Checks the Helm chart in helm/dspark-serve without a Kubernetes cluster.

1. `helm lint` (Helm 4 as a library, PyPI helm-python-sdk): no warnings or errors.
2. values.schema.json accepts the chart's defaults and every helm/dspark-serve/ci/*-values.yaml,
   and refuses values a user could get wrong (a test that it can fail); the templates refuse
   the drafter/model combinations the schema cannot see.
3. Renders the defaults and each ci values file and validates every object against the
   Kubernetes API schemas, strictly (PyPI kubernetes-validate).
4. Cross-checks each render against the real binary and itself: every DSPARK_* variable and
   --flag a dspark container gets is one `dspark <role> --help` lists; Service selectors, target
   ports, PDBs, the HPA and NetworkPolicies point at workloads and ports that exist; the
   scheduler and etcd URLs the pods get name Services of the render; every pod meets Pod Security
   "restricted" and mounts no service account token, every PDB lets a drain evict a pod, the
   target workers are a Deployment whose rolling update surges (a new pod before an old one
   goes, none unavailable), and with listenHost "[::]" nothing listens on 0.0.0.0. The `helm_values` of the
   capacity planner's committed plans (bench/results/plan-*.json) are rendered and checked too.
5. With --run: renders one replica of each component on free ports and starts every container
   of the render (init containers first) as a process on loopback, the way the kubelet would:
   the same command, arguments and environment, with the downward API's pod IP as 127.0.0.1,
   Service names resolved to 127.0.0.1, and the model cache at $DSPARK_HOME. It passes when the
   router reports the target and draft worker registered (through etcd, at the addresses they
   advertise) and answers a chat completion.

Usage: scripts/helm-check.py [--bin target/debug/dspark] [--run]
Needs: pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 pyyaml; for --run, etcd.
"""

import argparse
import base64
import glob
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(ROOT, "helm", "dspark-serve")
K8S_VERSION = "1.30.0"
# Read by the binaries outside clap (logging); everything else must be a documented flag's env.
NON_CLAP_ENV = {"DSPARK_LOG"}


def fail(msg):
    print(f"helm-check: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def load_values(path):
    with open(path) as f:
        return yaml.safe_load(f) or {}


def deep_merge(base, over):
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def render(helm, values, name="demo", namespace="prod", **opts):
    with helm.Chart.load(CHART) as c:
        files = c.render(values, name=name, namespace=namespace, **opts)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for d in yaml.safe_load_all(text):
            if d:
                docs.append(d)
    return docs


def pod_specs(docs):
    """(workload, pod template) for every Deployment and StatefulSet."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_schema(helm, values_sets):
    with helm.Chart.load(CHART) as c:
        for name, v in values_sets:
            try:
                c.validate_schema(v)
            except Exception as e:  # noqa: BLE001 (the SDK raises its own error types)
                fail(f"schema refuses {name}: {e}")
        bad = [
            ({"targetWorker": {"verifyPolicy": "fast"}}, "an unknown verify policy"),
            ({"targetWorker": {"gamma": 33}}, "a draft length over 32"),
            ({"router": {"replicas": "three"}}, "a string replica count"),
            ({"drafter": "eagle"}, "an unknown drafter"),
            ({"drafter": "none"}, "no drafter (a draft worker needs one)"),
            ({"etcd": {"endpoints": ["etcd:2379"]}}, "an etcd endpoint without a scheme"),
            ({"targetWorkers": {"replicas": 2}}, "a misspelt top-level key"),
            ({"listenHost": "localhost:80"}, "a listen host with a port"),
            ({"scheduler": {"prefixAffinitySlack": -1}}, "a negative affinity slack"),
            ({"targetWorker": {"prefixCaching": "yes"}}, "a string for prefix caching"),
            ({"router": {"toolCallParser": "mistral"}}, "a tool-call parser the router lacks"),
            ({"targetWorker": {"tensorParallel": {"size": 0}}}, "a tensor-parallel degree of 0"),
            ({"etcd": {"endpoints": ["https://etcd:2379"]}}, "a TLS etcd endpoint (the binaries speak plain HTTP/2)"),
            ({"router": {"fullWaitMs": 600001}}, "a full wait past the router's limit"),
            ({"listenHost": "::"}, "an IPv6 listen host without brackets"),
            ({"clusterToken": {"enabled": "yes"}}, "a string for the cluster token switch"),
            ({"clusterToken": {"value": "x"}}, "a cluster token in the values (the chart makes it)"),
            ({"router": {"pdb": {"minAvailable": 1}}}, "a router PDB by minAvailable (blocks drains of one router)"),
            ({"targetWorker": {"pdb": {"maxUnavailable": 0}}}, "a PDB that allows no eviction"),
            ({"draftWorker": {"pdb": {"maxUnavailable": "0%"}}}, "a PDB that allows no eviction, in percent"),
            ({"targetWorker": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}}},
             "a rolling update that may neither surge nor take a pod down"),
            ({"targetWorker": {"rollingUpdate": {"maxSurge": "one"}}}, "a surge that is neither a count nor a percentage"),
            # Its unsalted sha256 rolls the routers (checksum/api-key): a short key could be
            # recovered from it by whoever may read pods.
            ({"router": {"apiKey": {"value": "sk-short"}}}, "an API key under 16 characters"),
        ]
        for v, what in bad:
            try:
                c.validate_schema(v)
            except helm.HelmValuesError:
                continue
            fail(f"values.schema.json accepts {what}: {v}")
    # Combinations the schema takes but the templates refuse (`fail`): the worker would exit.
    bare = "drafter: bare"
    bad_renders = [
        ({"model": "smollm2-135m", "drafter": "draft-model"}, "draft-model for a model without a default draft", bare),
        ({"model": "/var/cache/dspark/own.gguf", "drafter": "draft-model"}, "draft-model for a path", bare),
        ({"model": "qwen2.5-coder-1.5b", "drafter": "dspark"}, "dspark for a model without a shipped drafter", bare),
        ({"router": {"service": {"type": "LoadBalancer"}}}, "a LoadBalancer without an API key", "without an API key"),
        ({"router": {"service": {"type": "NodePort"}}}, "a NodePort without an API key", "without an API key"),
        ({"networkPolicy": {"enabled": False}}, "an embedded etcd without NetworkPolicies", "etcd.allowUnprotected"),
        # lookup finds no cluster here, as under helm template or Argo CD: an upgrade would mint
        # a new token the running pods do not have.
        ({}, "an upgrade that cannot read the kept cluster token", "clusterToken.existingSecret",
         {"is_upgrade": True, "is_install": False}),
    ]
    for v, what, says, *opts in bad_renders:
        try:
            render(helm, v, **(opts[0] if opts else {}))
        except helm.HelmRenderError as e:
            if says in str(e):
                continue
            fail(f"the chart refuses {what} for another reason: {e}")
        fail(f"the chart renders {what}: {v}")
    # ...and still takes the ways out their messages name.
    good_renders = [
        ({"clusterToken": {"existingSecret": "mine"}}, "an upgrade with the user's cluster token",
         {"is_upgrade": True, "is_install": False}),
        ({"clusterToken": {"enabled": False}}, "an upgrade without a cluster token",
         {"is_upgrade": True, "is_install": False}),
        ({"networkPolicy": {"enabled": False}, "etcd": {"allowUnprotected": True}},
         "no NetworkPolicies, etcd knowingly unprotected", {}),
        ({"router": {"service": {"type": "NodePort"}, "apiKey": {"value": "sk-0123456789abcdef"}}}, "a NodePort with an API key", {}),
    ]
    for v, what, opts in good_renders:
        try:
            render(helm, v, **opts)
        except helm.HelmRenderError as e:
            fail(f"the chart refuses {what}: {e}")
    print(f"schema: {len(values_sets)} values sets accepted, {len(bad)} bad ones refused;"
          f" templates: {len(bad_renders)} bad combinations refused, {len(good_renders)} ways out taken")


def check_fetch_and_policies(helm):
    """Init containers fetch what the pods load; the router's /metrics stays scrapable."""
    def workload(docs, suffix):
        return next(tpl for w, tpl in pod_specs(docs) if w["metadata"]["name"].endswith(suffix))

    draft = "draft-model:qwen2.5-coder-0.5b"
    docs = render(helm, {"model": "qwen2.5-coder-1.5b", "drafter": draft})
    init = workload(docs, "-draft-worker")["spec"]["initContainers"][0]["args"]
    if init != ["fetch-model", "qwen2.5-coder-1.5b", "--drafter", draft]:
        fail(f"the draft workers' init container does not fetch their draft model: {init}")
    init = workload(docs, "-target-worker")["spec"]["initContainers"][0]["args"]
    if init != ["fetch-model", "qwen2.5-coder-1.5b"]:
        fail(f"the target workers' init container: {init}")
    for own in ("/models/own.gguf", "models/own.gguf"):
        docs = render(helm, {"model": own})
        for w, tpl in pod_specs(docs):
            if any(c["args"][0] == "fetch-model" for c in tpl["spec"].get("initContainers", [])):
                fail(f"{w['metadata']['name']} fetches the user's own file {own}")
    scraper = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    docs = render(helm, {"networkPolicy": {"routerIngressFrom": [{"podSelector": {"matchLabels": {"app": "lb"}}}],
                                           "metricsFrom": scraper}})
    check_k8s(docs, "restricted router ingress")
    pol = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-router"))
    if not any(r.get("from") == scraper for r in pol["spec"]["ingress"]):
        fail(f"the router's NetworkPolicy shuts out the scrapers of its /metrics: {pol['spec']['ingress']}")
    # IPv6: every listener, etcd's included, on listenHost.
    docs = render(helm, {"listenHost": "[::]"})
    check_hardening(docs, "listenHost [::]", "[::]")
    # A new API key rolls the routers; the cluster token outlives the release.
    ann = [workload(render(helm, {"router": {"apiKey": {"value": k}}}), "-router")["metadata"]["annotations"]
           .get("checksum/api-key") for k in ("sk-one-0123456789", "sk-two-0123456789")]
    if not ann[0] or ann[0] == ann[1]:
        fail(f"the router pods do not change with the API key: {ann}")
    tok = next(d for d in render(helm, {}) if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-cluster-token"))
    if tok["metadata"].get("annotations", {}).get("helm.sh/resource-policy") != "keep":
        fail("the cluster token's Secret is not kept (helm.sh/resource-policy: keep)")
    # The rolling update's values reach the Deployment (here: replace in place, no surge room).
    got = check_rollout(render(helm, {"targetWorker": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}}),
                        "in-place rollout", surge=False)
    if got != ("RollingUpdate", 0, 1):
        fail(f"targetWorker.rollingUpdate does not reach the Deployment: {got}")
    print("fetch and policies: the draft model fetched, own files left alone, router metrics scrapable,"
          " IPv6 listeners, routers rolled by a new API key, the cluster token kept,"
          " targetWorker.rollingUpdate applied")


def check_hardening(docs, label, listen_host):
    """Pod Security "restricted" on every pod, PDBs a drain gets through, IPv6 listening."""
    for w, tpl in pod_specs(docs):
        name, spec = w["metadata"]["name"], tpl["spec"]
        psc = spec.get("securityContext", {})
        if spec.get("automountServiceAccountToken") is not False:
            fail(f"{label}: {name} mounts a service account token (no pod calls the API)")
        for c in spec.get("initContainers", []) + spec["containers"]:
            csc = c.get("securityContext", {})
            seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
            if seccomp != "RuntimeDefault":
                fail(f"{label}: {name}/{c['name']} runs with seccomp profile {seccomp}, not RuntimeDefault")
            if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True or \
                    csc.get("runAsUser", psc.get("runAsUser")) == 0:
                fail(f"{label}: {name}/{c['name']} may run as root")
            if csc.get("allowPrivilegeEscalation") is not False:
                fail(f"{label}: {name}/{c['name']} allows privilege escalation")
            if "ALL" not in csc.get("capabilities", {}).get("drop", []) or csc.get("capabilities", {}).get("add"):
                fail(f"{label}: {name}/{c['name']} keeps capabilities: {csc.get('capabilities')}")
            if listen_host != "0.0.0.0":
                said = [str(a) for a in c.get("args", [])] + [str(e.get("value", "")) for e in c.get("env", [])]
                if any("0.0.0.0" in x for x in said):
                    fail(f"{label}: {name}/{c['name']} listens on 0.0.0.0 despite listenHost {listen_host}: {said}")
    # A PDB must let a node drain evict one pod even at the fewest replicas the render runs.
    hpa_min = {d["spec"]["scaleTargetRef"]["name"]: d["spec"]["minReplicas"]
               for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    for d in docs:
        if d["kind"] != "PodDisruptionBudget":
            continue
        sel = d["spec"]["selector"]["matchLabels"]
        for w, tpl in pod_specs(docs):
            if not matches(sel, tpl["metadata"]["labels"]):
                continue
            n = hpa_min.get(w["metadata"]["name"], w["spec"].get("replicas", 1))
            if n == 0:
                continue
            spec = d["spec"]

            def of(x):
                return math.ceil(n * int(x[:-1]) / 100) if isinstance(x, str) else int(x)
            allowed = min(of(spec["maxUnavailable"]), n) if "maxUnavailable" in spec else n - of(spec["minAvailable"])
            if allowed < 1:
                fail(f"{label}: PDB {d['metadata']['name']} allows no eviction of {n} pod(s): {spec}")


def check_rollout(docs, label, surge=True):
    """The target workers roll by surging: the replacement is ready before an old pod drains.

    A StatefulSet (or maxUnavailable > 0) would take a worker down first, so each step of an
    update would cost one worker's capacity for a drain, a model fetch, load and profile."""
    tw = [w for w, _ in pod_specs(docs) if w["metadata"]["name"].endswith("-target-worker")]
    if len(tw) != 1:
        fail(f"{label}: {len(tw)} target-worker workloads")
    w = tw[0]
    if w["kind"] != "Deployment":
        fail(f"{label}: the target workers are a {w['kind']}, not a Deployment (a StatefulSet cannot surge)")
    strat = w["spec"].get("strategy", {})
    ru = strat.get("rollingUpdate", {})
    n = max(w["spec"].get("replicas", 1), 1)

    def count(x, up):
        # A percentage of the replicas: maxSurge rounds up, maxUnavailable down (as the
        # Deployment controller does); the API defaults both to 25 %.
        x = "25%" if x is None else x
        if isinstance(x, str):
            f = n * int(x[:-1]) / 100
            return math.ceil(f) if up else math.floor(f)
        return int(x)
    got = (strat.get("type"), count(ru.get("maxSurge"), True), count(ru.get("maxUnavailable"), False))
    if surge and (got[0] != "RollingUpdate" or got[1] < 1 or got[2] != 0):
        fail(f"{label}: the target workers' rolling update does not surge with none unavailable: {strat}")
    return got


def check_k8s(docs, label):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump_all(docs, f)
        path = f.name
    try:
        r = subprocess.run(
            ["kubernetes-validate", "--strict", "-k", K8S_VERSION, "--quiet", path],
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(path)
    if r.returncode != 0:
        fail(f"{label}: kubernetes-validate --strict:\n{r.stdout}{r.stderr}")
    print(f"{label}: {len(docs)} objects valid against Kubernetes {K8S_VERSION} (strict)")


def help_text(binary, role, cache={}):  # noqa: B006 (a per-run memo)
    if role not in cache:
        r = subprocess.run([binary, role, "--help"], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"`dspark {role} --help` failed: {r.stderr}")
        cache[role] = r.stdout
    return cache[role]


def check_wiring(docs, binary, label, external_etcd):
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = list(pod_specs(docs))
    n_env = 0
    # Who carries the cluster token: every process that serves or calls gRPC, or none.
    token_of = {}
    for w, tpl in workloads:
        spec = tpl["spec"]
        containers = spec.get("initContainers", []) + spec["containers"]
        ann = tpl["metadata"].get("annotations", {})
        if "prometheus.io/port" in ann:
            cports = {str(p["containerPort"]) for c in spec["containers"] for p in c.get("ports", [])}
            if ann["prometheus.io/port"] not in cports:
                fail(f"{label}: {w['metadata']['name']} is scraped on port "
                     f"{ann['prometheus.io/port']}, which its containers do not open")
        for c in containers:
            if c.get("command") != ["dspark"]:
                continue
            role = c["args"][0]
            text = help_text(binary, role)
            if role in ("scheduler", "target-worker", "draft-worker", "router"):
                ref = next((e.get("valueFrom", {}).get("secretKeyRef") for e in c.get("env", [])
                            if e["name"] == "DSPARK_CLUSTER_TOKEN"), None)
                token_of[f"{w['metadata']['name']}/{c['name']}"] = ref and (ref["name"], ref["key"])
            for e in c.get("env", []):
                n = e["name"]
                if n.startswith("DSPARK_") and n not in NON_CLAP_ENV:
                    # `NAME=` with the value the environment holds; `NAME]` where the flag
                    # hides it (the API key).
                    if f"[env: {n}=" not in text and f"[env: {n}]" not in text:
                        fail(f"{label}: {w['metadata']['name']}/{c['name']} sets {n}, "
                             f"which `dspark {role} --help` does not list")
                    n_env += 1
                val = str(e.get("value", ""))
                if n in ("DSPARK_SCHEDULER", "DSPARK_ETCD") and not (n == "DSPARK_ETCD" and external_etcd):
                    for url in val.split(","):
                        m = re.match(r"^https?://([^:/]+):(\d+)$", url)
                        if not m:
                            fail(f"{label}: {n}={url} is not http://HOST:PORT")
                        svc = services.get(m.group(1))
                        if not svc or int(m.group(2)) not in [p["port"] for p in svc["spec"]["ports"]]:
                            fail(f"{label}: {n}={url} names no Service port of the render")
            # A drain the kubelet cuts short loses what it was for.
            envs = {e["name"]: str(e.get("value", "")) for e in c.get("env", [])}
            if "DSPARK_DRAIN_TIMEOUT_S" in envs:
                need = int(envs["DSPARK_DRAIN_TIMEOUT_S"]) + int(envs.get("DSPARK_SHUTDOWN_DELAY_S", "0"))
                grace = spec.get("terminationGracePeriodSeconds", 30)
                if grace <= need:
                    fail(f"{label}: {w['metadata']['name']} drains for {need} s but is killed "
                         f"after {grace} s (terminationGracePeriodSeconds)")
            for a in c["args"][1:]:
                if a.startswith("--"):
                    flag = a.split("=", 1)[0]
                    if not re.search(re.escape(flag) + r"(?![\w-])", text):
                        fail(f"{label}: {c['name']} passes {flag}, unknown to `dspark {role}`")
    if len(set(token_of.values())) > 1:
        fail(f"{label}: the gRPC processes do not share one cluster token: {token_of}")
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    for ref in set(token_of.values()) - {None}:
        if ref[0].endswith("-cluster-token") and ref[0] not in secrets:
            fail(f"{label}: the cluster token's Secret {ref[0]} is not in the render")
    # Services select pods and name their ports.
    for name, svc in services.items():
        sel = svc["spec"]["selector"]
        hit = [tpl for _, tpl in workloads if matches(sel, tpl["metadata"]["labels"])]
        if not hit:
            fail(f"{label}: Service {name} selects no pods")
        ports = {p["name"]: p["containerPort"] for c in hit[0]["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            if p["targetPort"] not in ports:
                fail(f"{label}: Service {name} targets port {p['targetPort']}, not on its pods")
    names = {(w["kind"], w["metadata"]["name"]) for w, _ in workloads}
    for d in docs:
        k = d["kind"]
        if k == "PodDisruptionBudget":
            sel = d["spec"]["selector"]["matchLabels"]
            if not any(matches(sel, tpl["metadata"]["labels"]) for _, tpl in workloads):
                fail(f"{label}: PDB {d['metadata']['name']} selects no pods")
        elif k == "HorizontalPodAutoscaler":
            ref = d["spec"]["scaleTargetRef"]
            if (ref["kind"], ref["name"]) not in names:
                fail(f"{label}: HPA targets {ref}, not in the render")
        elif k == "NetworkPolicy":
            sel = d["spec"]["podSelector"]["matchLabels"]
            hit = [tpl for _, tpl in workloads if matches(sel, tpl["metadata"]["labels"])]
            if not hit:
                fail(f"{label}: NetworkPolicy {d['metadata']['name']} selects no pods")
            cports = {p["containerPort"] for c in hit[0]["spec"]["containers"] for p in c.get("ports", [])}
            for rule in d["spec"]["ingress"]:
                for p in rule.get("ports", []):
                    if p["port"] not in cports:
                        fail(f"{label}: NetworkPolicy {d['metadata']['name']} opens {p['port']}, not a port of its pods")
                for peer in rule.get("from", []):
                    ps = peer.get("podSelector")
                    if ps and not any(matches(ps["matchLabels"], t["metadata"]["labels"]) for _, t in workloads):
                        fail(f"{label}: NetworkPolicy {d['metadata']['name']} admits pods that do not exist")
        elif k == "Deployment" and d["metadata"]["name"].endswith("-router"):
            # The router's Service must be reachable: the pods' readiness gates on /ready.
            probe = d["spec"]["template"]["spec"]["containers"][0].get("readinessProbe", {})
            if probe.get("httpGet", {}).get("path") != "/ready":
                fail(f"{label}: router readiness does not use /ready")
    print(f"{label}: wiring consistent ({len(workloads)} workloads, {len(services)} services, "
          f"{n_env} DSPARK_* variables known to the binary)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n):
    """The first of `n` consecutive free ports."""
    while True:
        first = free_port()
        if first + n > 65536:
            continue
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def run_render(helm, binary):
    """Starts the render's pods as loopback processes and serves one request through them."""
    ports = {k: free_port() for k in ("router", "scheduler", "smetrics", "target", "metrics", "draft", "dmetrics",
                                      "etcd", "peer")}
    # The target worker runs split three ways (SmolLM2 has 3 KV heads): ranks 1 and 2 on two
    # consecutive ports from tensorParallel.port.
    ports["tp"] = free_ports(2)
    values = {
        "router": {"port": ports["router"], "autoscaling": {"enabled": False}, "replicas": 1},
        "scheduler": {"port": ports["scheduler"], "metricsPort": ports["smetrics"]},
        "targetWorker": {"port": ports["target"], "metricsPort": ports["metrics"], "replicas": 1, "threads": 1,
                         "tensorParallel": {"size": 3, "port": ports["tp"]}},
        "draftWorker": {"port": ports["draft"], "metricsPort": ports["dmetrics"], "replicas": 1, "threads": 1},
        "etcd": {"clientPort": ports["etcd"], "peerPort": ports["peer"]},
        "registrationTtlMs": 1500,
    }
    docs = render(helm, values, name="loop", namespace="default")
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    secrets = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "Secret"}
    home = os.environ.get("DSPARK_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "dspark")
    tmp = tempfile.mkdtemp(prefix="dspark-helm-")
    order = ["etcd", "scheduler", "draft-worker", "target-worker", "router"]
    workloads = sorted(
        pod_specs(docs),
        key=lambda wt: order.index(wt[1]["metadata"]["labels"]["app.kubernetes.io/component"]),
    )
    procs = []

    def resolve_host(s):
        # Cluster DNS: a Service name (alone or before a port) is this machine.
        for name in sorted(services, key=len, reverse=True):
            s = re.sub(r"(?<![\w.-])" + re.escape(name) + r"(?=[:/]|$)", "127.0.0.1", s)
        return s

    def resource_of(spec, ref):
        # The downward API: a container's CPU request in whole units of the divisor, rounded up
        # (0 where it requests none).
        assert ref["resource"] == "requests.cpu", ref
        cs = spec.get("containers", []) + spec.get("initContainers", [])
        c = next(c for c in cs if c["name"] == ref["containerName"])
        cpu = str(c.get("resources", {}).get("requests", {}).get("cpu", "0"))
        cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        div = str(ref.get("divisor", "1"))
        unit = float(div[:-1]) / 1000 if div.endswith("m") else float(div)
        return math.ceil(cores / unit)

    def env_of(c, pod, spec):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        if os.environ.get("LD_LIBRARY_PATH"):
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        for e in c.get("env", []):
            if "value" in e:
                v = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
            else:
                src = e["valueFrom"]
                if "fieldRef" in src:
                    v = {"status.podIP": "127.0.0.1", "metadata.name": pod}[src["fieldRef"]["fieldPath"]]
                elif "resourceFieldRef" in src:
                    v = str(resource_of(spec, src["resourceFieldRef"]))
                else:
                    ref = src["secretKeyRef"]
                    v = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
            env[e["name"]] = resolve_host(v)
        for m in c.get("volumeMounts", []):
            if m["name"] == "model-cache":
                env["DSPARK_HOME"] = home
        return env

    def argv_of(c):
        cmd = c["command"][0]
        exe = {"dspark": binary, "etcd": "etcd"}[cmd]
        args = [resolve_host(a) for a in c.get("args", [])]
        if cmd == "etcd":
            args = [f"--data-dir={tmp}/etcd" if a.startswith("--data-dir=") else a for a in args]
        return [exe] + args

    try:
        for w, tpl in workloads:
            # Pod names as the controllers make them: a StatefulSet's ordinal, a Deployment's
            # ReplicaSet hash and random suffix (the workers register under theirs).
            pod = w["metadata"]["name"] + ("-0" if w["kind"] == "StatefulSet" else "-5d9c7b8f4-x2k7q")
            for c in tpl["spec"].get("initContainers", []):
                r = subprocess.run(argv_of(c), env=env_of(c, pod, tpl["spec"]), capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    fail(f"init container {pod}/{c['name']} exited {r.returncode}: {r.stderr[-2000:]}")
            for c in tpl["spec"]["containers"]:
                # The default values request CPUs of every worker: its threads follow them.
                threads = env_of(c, pod, tpl["spec"]).get("DSPARK_THREADS")
                if threads is not None and threads == "0":
                    fail(f"{pod}/{c['name']}: DSPARK_THREADS 0 despite its CPU request")
                log = open(os.path.join(tmp, f"{pod}-{c['name']}.log"), "w")
                p = subprocess.Popen(argv_of(c), env=env_of(c, pod, tpl["spec"]), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
                procs.append((f"{pod}/{c['name']}", p, log.name))
        base = f"http://127.0.0.1:{ports['router']}"
        t0, last = time.time(), None
        while True:
            for name, p, logf in procs:
                if p.poll() is not None:
                    fail(f"{name} exited {p.returncode}:\n{open(logf).read()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/ready", timeout=5) as r:
                    last = json.load(r)
                if last.get("target_workers") == 1 and last.get("draft_workers") == 1:
                    break
            except Exception as e:  # noqa: BLE001 (not up yet)
                last = str(e)
            if time.time() - t0 > 300:
                logs = "\n".join(f"--- {n}\n{open(lf).read()[-1500:]}" for n, _, lf in procs)
                fail(f"router not ready with 1 target + 1 draft worker after 300 s ({last}):\n{logs}")
            time.sleep(0.5)
        print(f"run: router ready after {time.time() - t0:.0f} s: {last}")
        body = json.dumps({
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "What is 2 plus 2?"}],
            "max_tokens": 12,
            "temperature": 0,
        }).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        text = out["choices"][0]["message"]["content"]
        if not text.strip() or out["usage"]["completion_tokens"] < 1:
            fail(f"empty completion: {out}")
        print(f"run: chat completion through the render's pods: {text!r}")
        # The workers' metrics ports, where the pod annotations send Prometheus.
        def scrape(component):
            tpl = next(t for _, t in workloads
                       if t["metadata"]["labels"]["app.kubernetes.io/component"] == component)
            ann = tpl["metadata"].get("annotations", {})
            url = f"http://127.0.0.1:{ann.get('prometheus.io/port')}{ann.get('prometheus.io/path')}"
            with urllib.request.urlopen(url, timeout=10) as r:
                return url, r.read().decode()
        url, page = scrape("target-worker")
        m = re.search(r"^dspark_target_generation_tokens_total (\d+)$", page, re.M)
        if not m or int(m.group(1)) < out["usage"]["completion_tokens"]:
            fail(f"target worker metrics at {url} miss the completion's tokens:\n{page[:2000]}")
        print(f"run: target worker metrics scraped as annotated: {m.group(1)} tokens generated")
        url, page = scrape("draft-worker")
        m = re.search(r"^dspark_draft_streams_open (\d+)$", page, re.M)
        if not m or int(m.group(1)) < 1:
            fail(f"draft worker metrics at {url} show no stream from the target worker:\n{page[:2000]}")
        print(f"run: draft worker metrics scraped as annotated: {m.group(1)} stream(s) open")
        url, page = scrape("scheduler")
        for role in ("target", "draft"):
            if not re.search(r'^dspark_scheduler_workers\{role="%s"\} 1$' % role, page, re.M):
                fail(f"scheduler metrics at {url} do not show the {role} worker:\n{page[:2000]}")
        print("run: scheduler metrics scraped as annotated: 1 target and 1 draft worker")
    finally:
        for _, p, _ in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        subprocess.run(["rm", "-rf", tmp])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "debug", "dspark"))
    ap.add_argument("--run", action="store_true", help="also start the render as loopback processes")
    a = ap.parse_args()
    try:
        import helm_python as helm
    except ImportError:
        fail("needs `python3 -m pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0` (.ci/run installs them)")
    if not os.access(a.bin, os.X_OK):
        fail(f"{a.bin} is not built (cargo build -p dspark)")
    lint = helm.lint(CHART)
    bad = [m for m in lint.get("messages", []) if m.get("severity", 0) >= 2] + lint.get("errors", [])
    if bad:
        fail(f"helm lint: {bad}")
    print("lint: clean")
    defaults = load_values(os.path.join(CHART, "values.yaml"))
    sets = [("defaults", {})] + [
        (os.path.relpath(p, ROOT), load_values(p)) for p in sorted(glob.glob(os.path.join(CHART, "ci", "*-values.yaml")))
    ]
    # The capacity planner's answers (`dspark plan --json`) are values this chart takes.
    for p in sorted(glob.glob(os.path.join(ROOT, "bench", "results", "plan-*.json"))):
        with open(p) as f:
            hv = json.load(f).get("helm_values")
        if hv:
            sets.append((os.path.relpath(p, ROOT) + " helm_values", hv))
    check_schema(helm, [(n, deep_merge(defaults, v)) for n, v in sets])
    check_fetch_and_policies(helm)
    for name, v in sets:
        docs = render(helm, v)
        check_k8s(docs, name)
        check_wiring(docs, a.bin, name, bool(v.get("etcd", {}).get("endpoints")))
        check_hardening(docs, name, deep_merge(defaults, v)["listenHost"])
        check_rollout(docs, name)
        print(f"{name}: pods restricted, PDBs drainable, target workers roll by surging")
    if a.run:
        run_render(helm, a.bin)
    print("helm-check: ok")


if __name__ == "__main__":
    main()
