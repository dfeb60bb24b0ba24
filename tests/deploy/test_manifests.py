"""The rendered deploy/k8s overlays agree with the code: ports, SPECDEC_* variables, health service names of
the probes, console scripts, drain times, and the wiring between the services (Services, DNS, NetworkPolicies).

Each overlay is rendered with the pinned `kubectl kustomize`; each service's configuration is then loaded
by the service's own loader (shared/config.py) from exactly the variables its pod gets, so a renamed
flag, a bad value or a wrong port fails here. Schema validation, yamllint, hadolint and checkov run in
`make k8s-validate`.
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
from importlib import import_module
from typing import Any

import pytest

from gateway.auth import parse_key_file
from gateway.config import GatewayConfig
from gateway.server import SERVICE_NAME as GATEWAY_SERVICE
from proposer_service.config import ProposerConfig
from proposer_service.server import SERVICE_NAME as PROPOSER_SERVICE
from shared.config import env_name, load_config
from shared.model.tp_group import TPGroup
from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    REPO,
    SERVICES,
    container,
    container_env,
    deployment,
    grpc_probes,
    named,
    of_kind,
    patched_environ,
    pod_labels,
    probe_target,
    render,
    selects,
)
from verifier_service.config import VerifierConfig
from verifier_service.server import SERVICE_NAME as VERIFIER_SERVICE

CONFIGS: dict[str, type] = {"gateway": GatewayConfig, "verifier": VerifierConfig, "proposer": ProposerConfig}
HEALTH_SERVICES = {"gateway": GATEWAY_SERVICE, "verifier": VERIFIER_SERVICE, "proposer": PROPOSER_SERVICE}
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
# SPECDEC_* variables read outside the config dataclasses (model locations and the weights cache).
OTHER_SPECDEC_VARS = {
    "SPECDEC_MODEL_DIR": "shared/settings.py",
    "SPECDEC_TARGET_MODEL": "shared/settings.py",
    "SPECDEC_DRAFT_MODEL": "shared/settings.py",
    "SPECDEC_CACHE_DIR": "shared/model/loader.py",
}
# Shutdown beyond the configured drain: the servers' final stop (1 s at most) and, for the model services,
# TPGroup.close (stop message, then waiting for the ranks: twice its timeout at worst).
TP_CLOSE_S = 2 * inspect.signature(TPGroup.close).parameters["timeout_s"].default
SERVER_STOP_S = 1.0
MARGIN_S = 5.0

CASES = [(o, s) for o in OVERLAYS for s in SERVICES]


def service_config(docs: tuple[dict, ...], component: str) -> Any:
    ctr = container(deployment(docs, component))
    env = container_env(docs, ctr)
    with patched_environ({k: v for k, v in env.items() if k.startswith("SPECDEC_")}):
        return load_config(CONFIGS[component], ctr.get("args", []))


def test_the_overlays_are_the_documented_ones():
    assert OVERLAYS == ["cpu", "cpu-secure", "cpu-tls", "gpu", "gpu-tracing"]
    docs = (REPO / "docs" / "deploy.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in docs


@pytest.mark.parametrize(("overlay", "component"), CASES)
def test_command_is_the_services_console_script(overlay, component):
    ctr = container(deployment(render(overlay), component))
    (script,) = ctr["command"]
    assert script == f"specdec-{component}"
    module, func = SCRIPTS[script].split(":")
    assert callable(getattr(import_module(module), func))


@pytest.mark.parametrize(("overlay", "component"), CASES)
def test_every_specdec_variable_is_one_the_service_reads(overlay, component):
    docs = render(overlay)
    env = container_env(docs, container(deployment(docs, component)))
    fields = {env_name(f.name) for f in dataclasses.fields(CONFIGS[component])}
    for path in set(OTHER_SPECDEC_VARS.values()):
        source = (REPO / path).read_text()
        assert all(var in source for var, p in OTHER_SPECDEC_VARS.items() if p == path)
    unknown = {k for k in env if k.startswith("SPECDEC_")} - fields - set(OTHER_SPECDEC_VARS)
    assert not unknown, f"{component} in {overlay}: variables no code reads: {sorted(unknown)}"
    service_config(docs, component)  # and their values load (types, ranges, addresses)


@pytest.mark.parametrize(("overlay", "component"), CASES)
def test_ports_and_grpc_probes_match_the_server(overlay, component):
    docs = render(overlay)
    dep = deployment(docs, component)
    ctr = container(dep)
    config = service_config(docs, component)
    # Every service serves gRPC; the gateway also its OpenAI-compatible HTTP API (--http-port).
    http_port = getattr(config, "http_port", 0)
    expected = {"grpc": config.port, **({"http": http_port} if http_port else {})}
    assert {p["name"]: p["containerPort"] for p in ctr["ports"]} == expected
    probes = dict(grpc_probes(ctr))
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}
    targets = {kind: probe_target(probe) for kind, probe in probes.items()}
    for kind, probe in probes.items():
        assert targets[kind][0] == config.port  # grpc.health.v1 on the service's port
        # Native gRPC probes speak no TLS: a TLS port is probed by gateway/health_probe.py (exec).
        assert ("exec" in probe) == bool(config.tls_cert_file)
    # Readiness asks for the service's own status (the gateway's means "a verifier is healthy"); liveness
    # asks for the overall status "".
    assert targets["readinessProbe"][1] == HEALTH_SERVICES[component]
    assert targets["livenessProbe"][1] == ""
    services = [s for s in of_kind(docs, "Service") if selects({"matchLabels": s["spec"]["selector"]}, pod_labels(dep))]
    assert services, f"no Service selects the {component} pods"
    for svc in services:
        assert {p["targetPort"]: p["port"] for p in svc["spec"]["ports"]} == expected


@pytest.mark.parametrize(("overlay", "component"), CASES)
def test_termination_grace_covers_the_services_drain(overlay, component):
    docs = render(overlay)
    spec = deployment(docs, component)["spec"]["template"]["spec"]
    config = service_config(docs, component)
    pre_stop = container(deployment(docs, component)).get("lifecycle", {}).get("preStop", {})
    needed = pre_stop.get("sleep", {}).get("seconds", 0) + SERVER_STOP_S + MARGIN_S
    if component == "gateway":
        needed += config.drain_timeout_s
    else:
        needed += config.grace_period_s + TP_CLOSE_S
    assert spec["terminationGracePeriodSeconds"] >= needed


@pytest.mark.parametrize(("overlay", "component"), CASES)
def test_pods_are_locked_down_and_have_writable_volumes_where_the_image_writes(overlay, component):
    docs = render(overlay)
    spec = deployment(docs, component)["spec"]["template"]["spec"]
    ctr = container(deployment(docs, component))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] >= 10000
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    sc = ctr["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    # No Kubernetes API access, and no service-link variables (SPECDEC_VERIFIER_PORT=tcp://...) in the
    # SPECDEC_* namespace that shared/config.py reads.
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    sa = named(docs, "ServiceAccount", spec["serviceAccountName"])
    assert sa["automountServiceAccountToken"] is False
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(ctr["resources"][kind])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    assert all(m["name"] in volumes for m in mounts.values())
    # Where the image points HOME, the caches and the models (deploy/docker/Dockerfile ENV).
    for path in ("/tmp", "/cache"):
        assert path in mounts and not mounts[path].get("readOnly", False)
    models = mounts["/models"]
    assert models["readOnly"] is True
    assert volumes[models["name"]]["persistentVolumeClaim"]["claimName"] == "specdec-models"
    named(docs, "PersistentVolumeClaim", "specdec-models")
    config = service_config(docs, component)
    model = config.tokenizer if component == "gateway" else config.model
    assert model.startswith("/models/"), "the model (or tokenizer) comes from the model volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_discovers_verifiers_through_the_headless_service(overlay):
    docs = render(overlay)
    gateway = service_config(docs, "gateway")
    verifier = service_config(docs, "verifier")
    proposer = service_config(docs, "proposer")
    host, port = gateway.verifier_dns.rsplit(":", 1)
    headless = named(docs, "Service", host)
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses", False)
    assert selects({"matchLabels": headless["spec"]["selector"]}, pod_labels(deployment(docs, "verifier")))
    assert int(port) == verifier.port
    assert gateway.health_service in ("", VERIFIER_SERVICE)
    (proposer_address,) = verifier.proposer
    host, port = proposer_address.rsplit(":", 1)
    svc = named(docs, "Service", host)
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(deployment(docs, "proposer")))
    assert int(port) == proposer.port


def allowed_ingress(docs: tuple[dict, ...], labels: dict[str, str]) -> list[dict]:
    """Every ingress rule of every NetworkPolicy that selects pods with `labels`."""
    rules = []
    for policy in of_kind(docs, "NetworkPolicy"):
        if selects(policy["spec"]["podSelector"], labels) and "Ingress" in policy["spec"]["policyTypes"]:
            rules.extend(policy["spec"].get("ingress", []))
    return rules


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_only_gateway_to_verifiers_only_verifiers_to_proposers(overlay):
    docs = render(overlay)
    deny = named(docs, "NetworkPolicy", "specdec-default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    pods = {c: pod_labels(deployment(docs, c)) for c in SERVICES}
    for target, source in (("verifier", "gateway"), ("proposer", "verifier")):
        port = service_config(docs, target).port
        rules = allowed_ingress(docs, pods[target])
        assert rules
        for rule in rules:
            assert [p["port"] for p in rule["ports"]] == [port]
            assert rule.get("from"), f"{target}: a rule without `from` admits every pod"
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}  # same namespace, no ipBlock
                admitted = [c for c, labels in pods.items() if selects(peer["podSelector"], labels)]
                assert admitted == [source]
    gateway_rules = allowed_ingress(docs, pods["gateway"])
    gateway = service_config(docs, "gateway")
    assert [p["port"] for r in gateway_rules for p in r["ports"]] == [gateway.port, gateway.http_port]


def min_replicas(docs: tuple[dict, ...], component: str) -> int:
    """The fewest pods the component runs: the autoscaler's minimum, else the Deployment's replicas."""
    name = f"specdec-{component}"
    hpas = [h for h in of_kind(docs, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == name]
    return hpas[0]["spec"]["minReplicas"] if hpas else deployment(docs, component)["spec"].get("replicas", 1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_protect_a_pod_and_gateway_autoscaler(overlay):
    """Issue 26, point 9: a budget that lets every pod go protects nothing. Each budget keeps at least one pod
    of its service through a drain (maxUnavailable below the fewest replicas), the gateway has one in every
    overlay, and a service without one runs a single pod (no budget can keep it up through a drain)."""
    docs = render(overlay)
    for component in SERVICES:
        labels = pod_labels(deployment(docs, component))
        pdbs = [p for p in of_kind(docs, "PodDisruptionBudget") if selects(p["spec"]["selector"], labels)]
        fewest = min_replicas(docs, component)
        assert len(pdbs) <= 1
        if component == "gateway" or fewest > 1:
            assert len(pdbs) == 1, f"{overlay}: {component} runs {fewest} pods and has no budget"
        for pdb in pdbs:
            assert "minAvailable" not in pdb["spec"]
            assert 1 <= pdb["spec"]["maxUnavailable"] < fewest, f"{overlay}: {component}'s budget protects nothing"
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specdec-gateway"}
    assert "replicas" not in deployment(docs, "gateway")["spec"]  # the autoscaler owns the count
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "specdec", doc["metadata"]["name"]


def gpus(dep: dict) -> tuple[int, int]:
    res = container(dep)["resources"]
    return int(res["requests"].get("nvidia.com/gpu", 0)), int(res["limits"].get("nvidia.com/gpu", 0))


@pytest.mark.parametrize("overlay", ["gpu", "gpu-tracing"])
def test_gpu_overlay_pools_and_tensor_parallel_size(overlay):
    docs = render(overlay)
    verifier, proposer = deployment(docs, "verifier"), deployment(docs, "proposer")
    tp = service_config(docs, "verifier").tensor_parallel_size
    assert tp > 1 and gpus(verifier) == (tp, tp)  # one tensor-parallel rank per GPU, in one pod
    proposer_tp = service_config(docs, "proposer").tensor_parallel_size
    assert gpus(proposer) == (proposer_tp, proposer_tp)
    pools = {c: deployment(docs, c)["spec"]["template"]["spec"]["nodeSelector"] for c in ("verifier", "proposer")}
    assert pools == {"verifier": {"specdec.io/gpu-pool": "large"}, "proposer": {"specdec.io/gpu-pool": "small"}}
    for dep in (verifier, proposer):
        tolerations = dep["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
        assert "/dev/shm" in {m["mountPath"] for m in container(dep)["volumeMounts"]}  # NCCL
        assert service_config(docs, dep["metadata"]["name"].removeprefix("specdec-")).device == "cuda"
    assert gpus(deployment(docs, "gateway")) == (0, 0)


def test_cpu_overlay_asks_for_no_gpu():
    docs = render("cpu")
    for component in SERVICES:
        assert gpus(deployment(docs, component)) == (0, 0)
        assert "nodeSelector" not in deployment(docs, component)["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_has_opentelemetry_settings(overlay):
    docs = render(overlay)
    for component in SERVICES:
        env = container_env(docs, container(deployment(docs, component)))
        assert env["OTEL_SERVICE_NAME"] == f"specdec-{component}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://specdec-otel-collector:4317"
        assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
        assert env["OTEL_TRACES_EXPORTER"] == ("otlp" if overlay == "gpu-tracing" else "none")


def test_tracing_component_collector_and_jaeger_are_wired():
    import yaml

    docs = render("gpu-tracing")
    collector = named(docs, "Service", "specdec-otel-collector")
    assert {"name": "otlp-grpc", "port": 4317}.items() <= collector["spec"]["ports"][0].items()
    dep = named(docs, "Deployment", "specdec-otel-collector")
    assert selects({"matchLabels": collector["spec"]["selector"]}, pod_labels(dep))
    (config_volume,) = dep["spec"]["template"]["spec"]["volumes"]
    config_map = named(docs, "ConfigMap", config_volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"]["collector.yaml"])
    assert container(dep)["args"] == ["--config=/conf/collector.yaml"]
    jaeger_host, jaeger_port = config["exporters"]["otlp/jaeger"]["endpoint"].split(":")
    jaeger = named(docs, "Service", jaeger_host)
    assert int(jaeger_port) in {p["port"] for p in jaeger["spec"]["ports"]}
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    # Only the specdec services reach the collector's OTLP ports; only the collector reaches Jaeger's.
    services = {c: pod_labels(deployment(docs, c)) for c in SERVICES}
    for rule in allowed_ingress(docs, pod_labels(dep)):
        if any(p["port"] == 4317 for p in rule["ports"]):
            assert all(selects(peer["podSelector"], services[c]) for peer in rule["from"] for c in SERVICES)
    jaeger_pods = pod_labels(named(docs, "Deployment", "specdec-jaeger"))
    for rule in allowed_ingress(docs, jaeger_pods):
        if any(p["port"] == 4317 for p in rule["ports"]):
            assert [selects(peer["podSelector"], pod_labels(dep)) for peer in rule["from"]] == [True]
    # Issue 26, point 9: the Jaeger UI and the collector's Prometheus endpoint are open to no pod (a rule
    # without `from`, or any rule naming them, would open them); port-forward reaches them.
    open_ports = {
        p["port"]
        for labels in (pod_labels(dep), jaeger_pods)
        for r in allowed_ingress(docs, labels)
        for p in r["ports"]
    }
    assert open_ports == {4317, 4318}
    for labels in (pod_labels(dep), jaeger_pods):
        assert all(rule.get("from") for rule in allowed_ingress(docs, labels))


def test_policy_skips_are_justified_in_the_docs():
    import yaml

    docs = (REPO / "docs" / "deploy.md").read_text()
    skipped = yaml.safe_load((K8S / "checkov.yaml").read_text())["skip-check"]
    ignored = yaml.safe_load((REPO / "deploy" / "docker" / "hadolint.yaml").read_text())["ignored"]
    for check in [*skipped, *ignored]:
        assert check in docs, f"{check} is skipped but not justified in docs/deploy.md"


def certificate_for(docs: tuple[dict, ...], secret: str) -> dict:
    (cert,) = [c for c in of_kind(docs, "Certificate") if c["spec"]["secretName"] == secret]
    return cert


def test_tls_component_internal_ca_certificates_mounts_and_settings():
    docs = render("cpu-tls")
    # self-signed Issuer -> CA Certificate -> CA Issuer -> one Certificate per service
    ca_cert = named(docs, "Certificate", "specdec-ca")
    assert ca_cert["spec"]["isCA"] is True
    assert "selfSigned" in named(docs, "Issuer", ca_cert["spec"]["issuerRef"]["name"])["spec"]
    ca_issuer = named(docs, "Issuer", "specdec-ca")
    assert ca_issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    configs = {c: service_config(docs, c) for c in SERVICES}
    for component in SERVICES:
        dep = deployment(docs, component)
        spec, ctr, config = dep["spec"]["template"]["spec"], container(dep), configs[component]
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        cert = certificate_for(docs, volume["secret"]["secretName"])
        assert cert["spec"]["issuerRef"]["name"] == "specdec-ca"
        assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
        assert "localhost" in cert["spec"]["dnsNames"]  # the exec probes' --tls-server-name
        for probe in dict(grpc_probes(ctr)).values():
            command = probe["exec"]["command"]
            assert command[command.index("--tls-server-name") + 1] == "localhost"
        # The whole Secret read-only (no subPath: a subPath mount never sees a renewal), where the config reads.
        (mount,) = [m for m in ctr["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True and "subPath" not in mount
        for name, file in (("cert", "tls.crt"), ("key", "tls.key"), ("ca", "ca.crt")):
            assert getattr(config, f"tls_{name}_file") == f"{mount['mountPath']}/{file}"
        assert config.require_client_cert is (component != "gateway")  # mutual TLS inside; public gateway
    # Each client can verify the server it dials: the verifiers by the headless name (pod IPs from DNS), the
    # proposer by its Service name.
    gateway, verifier = configs["gateway"], configs["verifier"]
    assert gateway.client_tls(gateway.tls_server_name) is not None
    assert gateway.tls_server_name in certificate_for(docs, "specdec-verifier-tls")["spec"]["dnsNames"]
    (proposer_address,) = verifier.proposer
    assert verifier.client_tls(verifier.tls_server_name) is not None and not verifier.tls_server_name
    assert proposer_address.rsplit(":", 1)[0] in certificate_for(docs, "specdec-proposer-tls")["spec"]["dnsNames"]
    for svc in of_kind(docs, "Service"):
        if svc["metadata"]["name"] in ("specdec-gateway", "specdec-verifier-headless", "specdec-proposer"):
            assert svc["spec"]["ports"][0]["appProtocol"] == "https"  # TLS, no longer cleartext h2c
    # Issue 26, point 9: one CA signs every service's certificate, so each internal server names the one
    # caller it admits, and that name is in the caller's certificate only.
    for server, caller in (("verifier", "gateway"), ("proposer", "verifier")):
        (allowed,) = configs[server].tls_allowed_client_names
        for component in SERVICES:
            cert = certificate_for(docs, f"specdec-{component}-tls")["spec"]
            names = {cert["commonName"], *cert["dnsNames"]}
            assert (allowed in names) is (component == caller), (server, component)


def test_overlays_without_the_tls_component_stay_plaintext():
    for overlay in ("cpu", "gpu", "gpu-tracing"):
        docs = render(overlay)
        assert not of_kind(docs, "Certificate")
        assert not any(service_config(docs, c).tls_cert_file for c in SERVICES)


API_KEYS_SECRET = "specdec-gateway-api-keys"


def test_api_keys_component_mounts_the_secret_read_only_where_the_gateway_reads_it():
    import yaml

    docs = render("cpu-secure")
    dep = deployment(docs, "gateway")
    spec, ctr = dep["spec"]["template"]["spec"], container(dep)
    (volume,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == API_KEYS_SECRET]
    assert not volume["secret"].get("optional", False)  # no Secret, no gateway: never serving without keys
    (item,) = volume["secret"]["items"]
    # The whole Secret folder read-only (no subPath: a subPath mount never sees an edit of the Secret).
    (mount,) = [m for m in ctr["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True and "subPath" not in mount
    path = f"{mount['mountPath']}/{item['path']}"
    assert container_env(docs, ctr)["SPECDEC_API_KEYS_FILE"] == path
    config = service_config(docs, "gateway")
    assert config.api_keys_file == path and config.tls_cert_file  # keys only over TLS in the example overlay
    for component in ("verifier", "proposer"):  # the key stays at the gateway
        assert API_KEYS_SECRET not in str(deployment(docs, component))
    assert not of_kind(docs, "Secret"), "keys must not pass through the repository or kustomize's output"
    # The placeholder the user copies: the Secret the pod mounts, holding no key.
    example = yaml.safe_load((K8S / "components" / "api-keys" / "api-keys-secret.example.yaml").read_text())
    assert (example["kind"], example["metadata"]["name"]) == ("Secret", API_KEYS_SECRET)
    assert example["metadata"]["namespace"] == "specdec"
    assert parse_key_file(example["stringData"][item["key"]]) == {}
    for overlay in (o for o in OVERLAYS if o != "cpu-secure"):
        assert not service_config(render(overlay), "gateway").api_keys_file
