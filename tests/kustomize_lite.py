"""A small ``kustomize build`` for the tests: renders deploy/k8s/ without the kustomize binary.

It implements the subset of kustomize that deploy/k8s/ uses, the way kustomize does it, and
refuses (``KustomizeError``) anything else, so an overlay that starts using another feature
fails the tests instead of rendering wrongly:

- ``resources``: YAML files (one or more documents each) inside the kustomization's folder, or
  folders holding a ``kustomization.yaml`` (rendered first, recursively);
- ``configMapGenerator``: ``name`` and ``files`` (the key is the file name), with
  ``options.labels`` and ``options.disableNameSuffixHash: true`` (kustomize's name-hash suffix
  is not reproduced, so it is required);
- ``patches``: ``path`` to a file with one strategic-merge patch, matched to a resource by
  apiVersion group, kind and name. Maps merge; ``null`` deletes a key; a top-level
  ``$patch: delete`` removes the resource; lists of containers, env vars, volumes, volume mounts,
  image pull secrets and ports merge by their Kubernetes merge key (an element with
  ``$patch: delete`` removes that element); every other list is replaced whole, as Kubernetes'
  strategic merge does for lists without a merge key (args, command, envFrom, tolerations...);
- ``images``: ``name`` with ``newTag`` and/or ``newName``, applied to the containers and init
  containers of pod templates;
- ``namespace``: set on every namespaced resource.

Not supported (refused or simply absent): JSON 6902 patches, patch ``target``/inline patches,
``patchesStrategicMerge``, ``$patch: replace``/``merge`` and ``$setElementOrder``, components,
generators other than the above (``secretGenerator``, ``envs``, ``literals``), name
prefixes/suffixes, ``labels``/``commonLabels``/``commonAnnotations``, ``replicas``, vars and
replacements, Helm charts, remote resources, and the namespace transformer's edits of
RoleBinding subjects or webhook configurations. Transformer order follows kustomize: resources
and generators, then patches, then namespace and images.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

KUSTOMIZATION = "kustomization.yaml"
SUPPORTED_FIELDS = {
    "apiVersion", "kind", "namespace", "resources", "patches", "images", "configMapGenerator",
}
# Kubernetes' patchMergeKey of the list fields deploy/k8s patches (PodSpec, Container, Service).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
CLUSTER_SCOPED_KINDS = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass",
}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not do, or is wrong."""


def build(directory: Path) -> list[Resource]:
    """The resources ``kustomize build directory`` would print, in file order (kustomize sorts
    them by kind; no check here depends on the order)."""
    directory = directory.resolve()
    spec = load_kustomization(directory)
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{directory}: kind {spec['kind']!r} is not supported")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            _add(resources, build(path), directory)
        else:
            _add(resources, load_documents(_inside(directory, entry)), directory)
    for generator in spec.get("configMapGenerator", []):
        _add(resources, [_config_map(directory, generator)], directory)
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{directory}: only `patches: - path: FILE` is supported")
        documents = load_documents(_inside(directory, entry["path"]))
        if len(documents) != 1:
            raise KustomizeError(f"{entry['path']}: one patch per file")
        resources = _apply_patch(resources, documents[0], entry["path"])
    if "namespace" in spec:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED_KINDS:
                resource.setdefault("metadata", {})["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        _set_image(resources, image)
    return resources


def load_kustomization(directory: Path) -> dict[str, Any]:
    path = directory / KUSTOMIZATION
    if not path.is_file():
        raise KustomizeError(f"{directory}: no {KUSTOMIZATION}")
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict):
        raise KustomizeError(f"{path}: not a mapping")
    return spec


def load_documents(path: Path) -> list[Resource]:
    """The non-empty YAML documents of ``path``."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def resource_id(resource: Resource) -> tuple[str, str, str]:
    """(API group, kind, name): how patches find their target (the version does not count)."""
    group = resource["apiVersion"].rpartition("/")[0]
    return group, resource["kind"], resource["metadata"]["name"]


def _inside(directory: Path, entry: str) -> Path:
    # kustomize's default load restrictor: files must live under the kustomization's folder.
    path = (directory / entry).resolve()
    if not path.is_relative_to(directory):
        raise KustomizeError(f"{directory}: {entry} is outside the kustomization's folder")
    if not path.is_file():
        raise KustomizeError(f"{directory}: {entry} does not exist")
    return path


def _add(resources: list[Resource], new: list[Resource], directory: Path) -> None:
    seen = {resource_id(r) for r in resources}
    for resource in new:
        if resource_id(resource) in seen:
            raise KustomizeError(f"{directory}: {resource_id(resource)} is defined twice")
        seen.add(resource_id(resource))
        resources.append(copy.deepcopy(resource))


def _config_map(directory: Path, generator: dict[str, Any]) -> Resource:
    if set(generator) - {"name", "files", "options"}:
        raise KustomizeError(f"configMapGenerator {generator.get('name')}: only name, files and "
                             "options are supported")
    options = generator.get("options", {})
    if set(options) - {"labels", "disableNameSuffixHash"}:
        raise KustomizeError("configMapGenerator options: only labels and disableNameSuffixHash")
    if options.get("disableNameSuffixHash") is not True:
        raise KustomizeError("configMapGenerator: the name-hash suffix is not reproduced here; "
                             "set options.disableNameSuffixHash: true")
    data = {}
    for entry in generator["files"]:
        if "=" in entry:
            raise KustomizeError("configMapGenerator files: KEY=FILE is not supported")
        data[Path(entry).name] = _inside(directory, entry).read_text()
    metadata: dict[str, Any] = {"name": generator["name"]}
    if "labels" in options:
        metadata["labels"] = dict(options["labels"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _apply_patch(resources: list[Resource], patch: Resource, path: str) -> list[Resource]:
    patch = copy.deepcopy(patch)
    directive = patch.pop("$patch", None)
    matches = [i for i, r in enumerate(resources) if resource_id(r) == resource_id(patch)]
    if len(matches) != 1:
        raise KustomizeError(f"{path}: patch target {resource_id(patch)} matched {len(matches)}")
    index = matches[0]
    if directive == "delete":
        return resources[:index] + resources[index + 1:]
    if directive is not None:
        raise KustomizeError(f"{path}: $patch: {directive} is not supported")
    resources[index] = merge(resources[index], patch)
    return resources


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of ``patch`` into ``base`` (a new value; neither is changed)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if "$patch" in patch or any(k.startswith("$setElementOrder") for k in patch):
            raise KustomizeError(f"{field}: patch directives inside maps are not supported")
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field, base + patch)
        if key is not None:
            return _merge_list(base, patch, key, field)
    return copy.deepcopy(patch)


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":
        # Container ports merge by containerPort, Service ports by port.
        return "containerPort" if any("containerPort" in i for i in items) else "port"
    return MERGE_KEYS.get(field)


def _merge_list(base: list[Any], patch: list[Any], key: str, field: str) -> list[Any]:
    merged = copy.deepcopy(base)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise KustomizeError(f"{field}: every element needs its merge key {key!r}")
        item = dict(item)
        directive = item.pop("$patch", None)
        position = next((i for i, old in enumerate(merged) if old.get(key) == item[key]), None)
        if directive == "delete":
            if position is not None:
                del merged[position]
        elif directive is not None:
            raise KustomizeError(f"{field}: $patch: {directive} is not supported")
        elif position is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[position] = merge(merged[position], item, field)
    return merged


def pod_spec(resource: Resource) -> dict[str, Any] | None:
    """The pod template's spec of a workload, None for other kinds."""
    if resource["kind"] not in POD_TEMPLATE_KINDS:
        return None
    spec: dict[str, Any] = resource["spec"]["template"]["spec"]
    return spec


def _set_image(resources: list[Resource], image: dict[str, Any]) -> None:
    if set(image) - {"name", "newTag", "newName"}:
        raise KustomizeError(f"images: only name, newTag and newName are supported: {image}")
    for resource in resources:
        spec = pod_spec(resource)
        if spec is None:
            continue
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            if "@" in container["image"]:
                raise KustomizeError(f"{container['image']}: digests are not supported")
            name, tag = split_image(container["image"])
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name


def split_image(image: str) -> tuple[str, str]:
    """(name, tag) of ``registry[:port]/path:tag``; the tag is "" when there is none."""
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon + 1:]
    return image, ""
