"""The operator's kit in deploy/: alert rules (promtool), a real Prometheus scraping a
running stack, the dashboard's queries, the container entrypoint, the Kubernetes example
and the S3 policy.

``promtool`` and ``prometheus`` come from Debian's ``prometheus`` package (``make
prometheus-tools`` installs it); where it cannot be installed the tests that need it
skip, saying so in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtiers.stack.builder import load_stack
from kvtiers.stack.metrics_catalog import HISTOGRAMS, STACK, TIER

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus" / "kvtiers-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "kvtiers-alerts.test.yml"
MODEL = {"name": "deploy/model",
         "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "2KiB"}]}
#: How long a Prometheus started here may take to scrape the exporter once.
SCRAPE_DEADLINE_S = 60.0
#: Every family the exporter can export (histograms with their series suffixes).
FAMILIES = ({spec.family for spec in (*STACK.values(), *TIER.values())}
            | {f"{name}_{suffix}" for name, _ in HISTOGRAMS.values()
               for suffix in ("bucket", "sum", "count")}
            | {"kvtiers_build_info"})


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian's prometheus package: "
                    "make prometheus-tools)")
    return path


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = _tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                            capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def _series_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(kvtiers_[a-z_]+)", expr))


def test_rules_and_dashboard_name_only_exported_series() -> None:
    rules = yaml.safe_load(RULES.read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "kvtiers-dashboard.json").read_text())
    exprs += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"])
    named = set().union(*map(_series_in, exprs))
    assert named, "no kvtiers series named"
    assert named <= FAMILIES, f"not exported: {sorted(named - FAMILIES)}"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        document = json.loads(response.read())
    assert document["status"] == "success", document
    result: list[dict[str, Any]] = document["data"]["result"]
    return result


@pytest.fixture
def prometheus_scraping(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A running stack with an exporter and a real Prometheus scraping it every second,
    with deploy/'s rules loaded: (Prometheus's base URL, the stack)."""
    binary = _tool("prometheus")
    stack = load_stack({"tiers": [{"kind": "cpu", "capacity": "1MiB"},
                                  {"kind": "file", "root": str(tmp_path / "file")}],
                        "model": MODEL, "metrics": {"port": 0, "refresh_s": 0}})
    assert stack.metrics is not None
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kvtiers", "static_configs": [
            {"targets": [f"127.0.0.1:{stack.metrics.port}"]}]}],
    }))
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", stack
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        stack.shutdown()


def test_a_real_prometheus_scrapes_every_series_from_the_start(
    prometheus_scraping: tuple[str, Any],
) -> None:
    base, _stack = prometheus_scraping
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    found: list[dict[str, Any]] = []
    while not found:
        try:
            found = _query(base, "kvtiers_build_info")
        except OSError:
            found = []
        if not found:
            assert time.monotonic() < deadline, "Prometheus never scraped the exporter"
            time.sleep(0.5)  # polling a server's progress, not synchronising threads
    from kvtiers import __version__

    (info,) = found
    assert info["metric"]["version"] == __version__ and info["value"][1] == "1"
    # Before any request: each stack series is there, at zero.
    for spec in STACK.values():
        selector = ",".join(f'{k}="{v}"' for k, v in spec.labels.items())
        result = _query(base, f"{spec.family}{{{selector}}}")
        assert [r["value"][1] for r in result] == ["0"], spec
    counts = _query(base, "kvtiers_promotion_latency_seconds_count")
    assert [(r["metric"]["tier"], r["value"][1]) for r in counts] == [("file", "0")]
    # deploy/'s rules loaded and evaluated without error; nothing fires on a healthy stack.
    with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10) as response:
        groups = json.loads(response.read())["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(yaml.safe_load(RULES.read_text())["groups"][0]["rules"])
    assert all(rule["health"] in ("ok", "unknown") for rule in rules), rules
    assert _query(base, 'ALERTS{alertstate="firing"}') == []


def test_the_container_entrypoint_checks_then_serves_with_the_stack(tmp_path: Path) -> None:
    text = (DEPLOY / "Containerfile").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("ENTRYPOINT ")]
    entrypoint = json.loads(line[len("ENTRYPOINT "):])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kvtiers").write_text(f"#!/bin/sh\nexec {sys.executable} -m kvtiers \"$@\"\n")
    (bin_dir / "vllm").write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; "
        "print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    stack = tmp_path / "stack.yaml"
    stack.write_text(f"tiers:\n  - kind: cpu\n    capacity: 16MiB\n"
                     f"  - kind: file\n    root: {tmp_path / 'kv'}\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KVTIERS_STACK": str(stack)}
    served = subprocess.run([*entrypoint, "MODEL", "--enable-prefix-caching"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert served.returncode == 0, served.stderr
    args = json.loads(served.stdout.splitlines()[-1])
    assert args[:4] == ["serve", "MODEL", "--enable-prefix-caching", "--shutdown-timeout"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVTiersConnector"
    assert config["kv_connector_extra_config"]["kvtiers_config"] == str(stack)
    # A stack that cannot start stops the container before vLLM, in one line.
    stack.write_text("tiers:\n  - kind: cpu\n    capacity: 16MiB\n"
                     "  - kind: file\n    root: /proc/kvtiers\n")
    refused = subprocess.run([*entrypoint, "MODEL"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines()[0].startswith(f"{stack}: tiers[1].root: ")


def test_the_kubernetes_example_mounts_what_the_stack_names() -> None:
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "kvtiers-vllm.yaml")
                                        .read_text()))
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"ConfigMap", "Secret", "Deployment", "Service"}
    from kvtiers.config import load_stack_config

    stack = load_stack_config(yaml.safe_load(kinds["ConfigMap"]["data"]["stack.yaml"]))
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/kvtiers", "/dev/shm", str(stack.tiers[1].root)} <= mounts  # type: ignore[attr-defined]
    assert stack.metrics is not None
    assert {"containerPort": stack.metrics.port, "name": "kvtiers-metrics"} in container["ports"]
    assert container["envFrom"] == [{"secretRef": {"name": kinds["Secret"]["metadata"]["name"]}}]


def test_the_s3_policy_grants_only_what_a_tier_uses() -> None:
    policy = json.loads((DEPLOY / "s3" / "kvtiers-policy.json").read_text())
    actions = {a for statement in policy["Statement"] for a in statement["Action"]}
    assert actions == {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
    assert all(statement["Effect"] == "Allow" and "*" not in statement["Resource"].split(":::")[1]
               .split("/")[0] for statement in policy["Statement"])


def test_the_node_service_daemonset_shares_its_socket_and_pool_with_the_engines() -> None:
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "kvtiers-service.yaml")
                                        .read_text()))
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"ConfigMap", "DaemonSet", "Deployment"}
    from kvtiers.config import load_stack_config

    data = kinds["ConfigMap"]["data"]
    served = load_stack_config(yaml.safe_load(data["serve.yaml"]))
    engine = load_stack_config(yaml.safe_load(data["stack.yaml"]))
    assert served.tiers[0].kind == "cpu" and served.model is not None
    (tier,) = engine.tiers
    assert tier.kind == "service"
    socket = str(tier.socket)  # type: ignore[attr-defined]
    service = kinds["DaemonSet"]["spec"]["template"]["spec"]
    engines = kinds["Deployment"]["spec"]["template"]["spec"]
    (serve,) = service["containers"]
    command = serve["command"]
    assert command[:2] == ["kvtiers", "serve"]
    assert command[command.index("--socket") + 1] == socket
    assert command[command.index("--config") + 1] == "/etc/kvtiers/serve.yaml"

    def host_paths(pod: dict[str, object], container: dict[str, object]) -> dict[str, str]:
        """mount path -> the host path behind it (hostPath volumes only)."""
        volumes = {v["name"]: v for v in pod["volumes"]}  # type: ignore[attr-defined]
        return {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
                for m in container["volumeMounts"]  # type: ignore[attr-defined]
                if "hostPath" in volumes[m["name"]]}

    (vllm,) = engines["containers"]
    served_paths, engine_paths = host_paths(service, serve), host_paths(engines, vllm)
    # The socket's directory and the pool's /dev/shm are the same host paths in both
    # pods, so they outlive either; both run as one uid (the socket and pool are 0600).
    shared = {str(Path(socket).parent), "/dev/shm"}
    assert shared <= set(served_paths) and shared <= set(engine_paths)
    assert all(served_paths[p] == engine_paths[p] for p in shared)
    assert service["securityContext"] == engines["securityContext"]
    assert {"name": "KVTIERS_STACK", "value": "/etc/kvtiers/stack.yaml"} in vllm["env"]
    port = int(command[command.index("--metrics-port") + 1])
    assert {"name": "kvtiers-metrics", "containerPort": port} in serve["ports"]
