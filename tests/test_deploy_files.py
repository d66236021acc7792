"""The deployment files (Containerfile, deploy/compose.yaml, deploy/k8s/): what `docker compose
config` and `kubectl apply --dry-run` would check, done here without either: the YAML parses,
passes the Compose Specification's schema (the copy vendored by check-jsonschema) and the
Kubernetes API's schemas (bundled by kubernetes-validate, strict: unknown fields are errors),
and every member config they mount is one meshd loads, naming the members as the manifests do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from meshjobs.config import load_config
from tests.helpers import ROOT, Meshd

DEPLOY = os.path.join(ROOT, "deploy")
COMPOSE = os.path.join(DEPLOY, "compose.yaml")
K8S = os.path.join(DEPLOY, "k8s")
CONTAINERFILE = os.path.join(ROOT, "Containerfile")


def compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for name in sorted(os.listdir(K8S)):
        if name.endswith((".yaml", ".yml")):
            with open(os.path.join(K8S, name)) as f:
                docs += [(name, d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


def k8s_kind(kind: str) -> list[dict]:
    return [d for _, d in k8s_docs() if d["kind"] == kind]


def check_compose_schema(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           "vendor.compose-spec", path], capture_output=True, text=True,
                          timeout=120)


# --- compose ---------------------------------------------------------------------------------

def test_compose_passes_the_compose_spec_schema():
    """deploy/compose.yaml against the Compose Specification's JSON schema (offline)."""
    out = check_compose_schema(COMPOSE)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_schema_check_catches_a_mistake(tmp_path):
    """The check is a real one: a misspelt key and a wrong type are refused."""
    doc = compose()
    doc["services"]["v1"]["restrat"] = "always"
    doc["services"]["v2"]["ports"] = "7700"
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(doc))
    out = check_compose_schema(str(bad))
    assert out.returncode != 0 and "restrat" in out.stdout


def test_compose_fleet_is_three_voters_and_two_workers():
    """Each service mounts its own config (name = the service name, at the image's default
    config path); the voters named in every config are the voter services, by service name;
    the fleet secret is a compose secret given to every member."""
    doc = compose()
    services = doc["services"]
    assert sorted(services) == ["v1", "v2", "v3", "w1", "w2"]
    assert set(doc["secrets"]) == {"fleet_secret"}
    roles = {}
    for name, svc in services.items():
        (mount,) = svc["configs"]
        assert mount["target"] == "/etc/meshjobs/meshd.toml"
        path = os.path.join(DEPLOY, doc["configs"][mount["source"]]["file"])
        cfg = load_config(path)
        assert cfg.name == name
        roles[name] = cfg.role
        assert [(v.name, v.raft, v.peer) for v in cfg.voters] == [
            (v, (v, 7702), (v, 7701)) for v in ("v1", "v2", "v3")]
        assert cfg.secret_path == "/run/secrets/fleet_secret"
        assert [s["source"] for s in svc["secrets"]] == ["fleet_secret"]
        assert [s["target"] for s in svc["secrets"]] == ["fleet_secret"]
        # Readable by the image's user (10001) alone, read-only (issue 25).
        assert [(s["uid"], s["gid"], s["mode"]) for s in svc["secrets"]] == [
            ("10001", "10001", 0o400)]
        # The healthcheck asks 127.0.0.1: HTTP listens on every address of the container.
        assert cfg.http == ("0.0.0.0", 7700) and cfg.auth.configured
        assert any(v.endswith(":/var/lib/meshjobs") for v in svc["volumes"])
        if cfg.role == "worker":
            assert cfg.peer == (name, 7701)
    assert roles == {"v1": "voter", "v2": "voter", "v3": "voter", "w1": "worker",
                     "w2": "worker"}


# --- kubernetes ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,doc", k8s_docs(), ids=lambda x: x if isinstance(x, str) else
                         f"{x['kind']}/{x['metadata']['name']}")
def test_k8s_manifest_passes_the_api_schema(name, doc):
    """Each manifest against the Kubernetes API's schema, strictly (no unknown fields)."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)


def test_k8s_schema_check_catches_a_mistake():
    """The check is a real one: a misspelt probe and a wrong type are refused."""
    import kubernetes_validate

    (sts,) = k8s_kind("StatefulSet")
    version = kubernetes_validate.utils.latest_version()
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, version, strict=True)
    (sts,) = k8s_kind("StatefulSet")
    sts["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, version, strict=True)


def test_k8s_voters_are_a_statefulset_with_stable_names(tmp_path):
    """3 voters with stable DNS names (headless Service, names published before ready),
    volumes of their own, a disruption budget keeping a quorum, readiness on /healthz; each
    voter's config in the ConfigMap names the voters by those DNS names."""
    (sts,) = k8s_kind("StatefulSet")
    (pdb,) = k8s_kind("PodDisruptionBudget")
    (cm,) = k8s_kind("ConfigMap")
    headless = next(s for s in k8s_kind("Service") if s["metadata"]["name"] ==
                    sts["spec"]["serviceName"])
    spec, ns = sts["spec"], sts["metadata"]["namespace"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert headless["spec"]["selector"] == spec["selector"]["matchLabels"]
    (meshd,) = spec["template"]["spec"]["containers"]
    assert meshd["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert meshd["args"] == ["--config", "/etc/meshjobs/$(POD_NAME).toml"]
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(spec["replicas"])]
    names = [f"{p}.{spec['serviceName']}.{ns}.svc.cluster.local" for p in pods]
    for pod, dns in zip(pods, names, strict=True):
        path = tmp_path / f"{pod}.toml"
        path.write_text(cm["data"][f"{pod}.toml"])
        cfg = load_config(str(path))
        assert cfg.name == pod and cfg.role == "voter"
        assert [v.raft for v in cfg.voters] == [(n, 7702) for n in names]
        assert cfg.raft == (dns, 7702) and cfg.peer == (dns, 7701)
        assert cfg.http == ("0.0.0.0", 7700)


def test_k8s_workers_are_a_deployment(tmp_path):
    """Workers: a Deployment; each names itself after its pod and offers links on the pod's
    address; worker.toml is a worker's config (not a voter) naming the same voters."""
    (dep,) = k8s_kind("Deployment")
    (cm,) = k8s_kind("ConfigMap")
    (meshd,) = dep["spec"]["template"]["spec"]["containers"]
    assert meshd["args"] == ["--config", "/etc/meshjobs/worker.toml", "--name", "$(POD_NAME)",
                             "--peer", "$(POD_IP):7701"]
    assert meshd["readinessProbe"]["httpGet"]["path"] == "/healthz"
    path = tmp_path / "worker.toml"
    path.write_text(cm["data"]["worker.toml"])
    cfg = load_config(str(path), {"name": "meshd-worker-5d9c7b8f6-x7k2p",
                                  "peer": "10.1.2.3:7701"})
    assert cfg.role == "worker" and len(cfg.voters) == 3
    assert cfg.peer == ("10.1.2.3", 7701)


def test_k8s_fleet_secret_is_a_secret_copied_private():
    """The fleet secret is a Secret; an init container copies it with mode 0600 to where each
    member's config looks for it (meshd refuses one others may read)."""
    (secret,) = k8s_kind("Secret")
    key = "fleet.secret"
    assert key in secret["data"]
    for workload in (*k8s_kind("StatefulSet"), *k8s_kind("Deployment")):
        pod = workload["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["fleet-secret"]["secret"]["secretName"] == secret["metadata"]["name"]
        (init,) = pod["initContainers"]
        assert init["command"][:3] == ["install", "-m", "0600"]
        assert init["command"][-1] == "/var/lib/meshjobs/fleet.secret"
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_k8s_items_reach_no_token_and_no_secret_mount():
    """Issue 25: no service-account token is mounted (items could read it), the Secret volume
    is mode 0400, and meshd's own container (where items run) does not mount it at all: only the
    init container reads it, to copy it 0600 into the data volume. No container may gain
    privileges or keep a capability."""
    for workload in (*k8s_kind("StatefulSet"), *k8s_kind("Deployment")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["fleet-secret"]["secret"]["defaultMode"] == 0o400
        (meshd,) = pod["containers"]
        assert "fleet-secret" not in {m["name"] for m in meshd["volumeMounts"]}
        for c in (meshd, *pod["initContainers"]):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert "add" not in ctx["capabilities"]


# --- the image -------------------------------------------------------------------------------

def containerfile() -> list[tuple[str, str]]:
    """The Containerfile's instructions (continuation lines joined), as (INSTRUCTION, rest)."""
    with open(CONTAINERFILE) as f:
        text = re.sub(r"\\\n", " ", f.read())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_containerfile():
    """A slim Python 3.11 base, the package installed, a non-root user, a data volume, a
    health check on /healthz, meshd as the entry point; Dockerfile is the same file."""
    assert os.path.realpath(os.path.join(ROOT, "Dockerfile")) == os.path.realpath(CONTAINERFILE)
    steps = containerfile()
    froms = [rest for word, rest in steps if word == "FROM"]
    assert froms and all("python:3.11-slim" in f for f in froms)
    assert any(word == "RUN" and "pip install" in rest for word, rest in steps)
    (user,) = [rest for word, rest in steps if word == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    assert ("VOLUME", '["/var/lib/meshjobs"]') in steps
    # The data volume's folder is the image user's alone (a new volume takes its mode).
    assert any(word == "RUN" and "install -d -m 0700 -o meshjobs -g meshjobs /var/lib/meshjobs"
               in rest for word, rest in steps)
    (entry,) = [rest for word, rest in steps if word == "ENTRYPOINT"]
    assert json.loads(entry) == ["meshd"]
    (health,) = [rest for word, rest in steps if word == "HEALTHCHECK"]
    assert "urllib" in health and "curl" not in health


def healthcheck_argv() -> list[str]:
    (health,) = [rest for word, rest in containerfile() if word == "HEALTHCHECK"]
    return json.loads(health.split("CMD", 1)[1])


@pytest.mark.fleet
def test_containerfile_healthcheck_asks_healthz(tmp_path):
    """The image's health check command, run here: 0 against a serving member, not 0 where
    none listens."""
    argv = healthcheck_argv()
    assert argv[0] == "python"
    argv[0] = sys.executable
    m = Meshd(str(tmp_path / "m1"))
    try:
        m.start()
        ok = subprocess.run(argv, env={**os.environ, "MESHJOBS_HEALTHZ": m.url + "/healthz"},
                            capture_output=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
    finally:
        m.stop()
    down = subprocess.run(argv, env={**os.environ, "MESHJOBS_HEALTHZ": m.url + "/healthz"},
                          capture_output=True, timeout=60)
    assert down.returncode != 0
