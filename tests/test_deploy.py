"""The Kubernetes manifests of deploy/: Kubernetes' own kinds checked against its JSON schemas (strict:
no field the API does not know), the pods inside a LeaderWorkerSet as the pod templates they are, the
custom resources' fields against their API references, and every jaxserve command line in them
against run_server.py's parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import run_server

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.33.0"  # (GKE's regular channel at the time of writing)
# The fields of the custom resources (LeaderWorkerSet v1; InferencePool of the Gateway API Inference
# Extension v1; HTTPRoute of the Gateway API v1), from their API references: path -> known keys.
CUSTOM_FIELDS = {
    "LeaderWorkerSet": {
        "spec": {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"},
        "spec.leaderWorkerTemplate": {"size", "leaderTemplate", "workerTemplate", "restartPolicy", "subGroupPolicy"},
    },
    "InferencePool": {
        "spec": {"selector", "targetPorts", "appProtocol", "endpointPickerRef"},
        "spec.selector": {"matchLabels"},
        "spec.endpointPickerRef": {"group", "kind", "name", "port", "failureMode"},
    },
    "HTTPRoute": {
        "spec": {"parentRefs", "hostnames", "rules"},
        "spec.rules[]": {"name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence"},
        "spec.rules[].backendRefs[]": {"group", "kind", "name", "namespace", "port", "weight", "filters"},
    },
}


LWS_VALUES = {"LWS_LEADER_ADDRESS": "jaxserve-slice-0.jaxserve-slice", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "1"}


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _at(doc, path: str) -> list:
    """The values at a dotted path, "[]" stepping into each item of a list."""
    values = [doc]
    for part in path.split("."):
        key, many = part.removesuffix("[]"), part.endswith("[]")
        values = [v[key] for v in values if key in v]
        if many:
            values = [item for v in values for item in v]
    return values


def _pod_templates(doc: dict) -> list[dict]:
    template = doc["spec"]["leaderWorkerTemplate"]
    return [template[name] for name in ("leaderTemplate", "workerTemplate") if name in template]


def _commands(doc: dict) -> list[list[str]]:
    """The argument lists of run_server.py in the resource's containers (the image's entry point runs
    it: args alone are its flags; `sh -c "exec python run_server.py ..."` is split as the shell would,
    with the $(VAR)s LeaderWorkerSet fills in given values it could)."""
    templates = _pod_templates(doc) if doc["kind"] == "LeaderWorkerSet" else [doc["spec"]["template"]] \
        if doc["kind"] == "Deployment" else []
    commands = []
    for template in templates:
        for container in template["spec"]["containers"]:
            if container.get("command") == ["sh", "-c"]:
                words = shlex.split(re.sub(r"\$\((\w+)\)", lambda m: LWS_VALUES[m[1]], container["args"][0]))
                commands.append(words[words.index("run_server.py") + 1:])
            else:
                commands.append(container.get("args", []))
    return commands


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifests_are_valid_for_kubernetes(doc):
    if doc["kind"] not in CUSTOM_FIELDS:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        return
    for path, known in CUSTOM_FIELDS[doc["kind"]].items():
        for value in _at(doc, path):
            assert set(value) <= known, (path, set(value) - known)
    if doc["kind"] == "LeaderWorkerSet":
        for template in _pod_templates(doc):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": template}, KUBERNETES, strict=True)


def test_the_manifests_command_lines_are_jaxserves_and_the_pieces_meet():
    docs = documents()
    commands = [command for doc in docs for command in _commands(doc)]
    assert len(commands) == 3
    for command in commands:
        run_server.parse_args(command)  # (exits on a flag it does not know)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pool = by_kind["InferencePool", "jaxserve"]
    pods = by_kind["Deployment", "jaxserve"]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"][0]["number"] == pods["spec"]["containers"][0]["ports"][0]["containerPort"]
    route = by_kind["HTTPRoute", "jaxserve"]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "jaxserve"
