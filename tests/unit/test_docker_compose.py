"""docker-compose.yml cannot run here (no Docker engine), so check what can be checked without one."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from iotmon.cli import build_parser
from tests.support import PROJECT_ROOT

COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
APP_SERVICES = {name: svc for name, svc in COMPOSE["services"].items() if svc.get("image", "").startswith("iotmon")}


def test_every_app_service_runs_a_real_iotmon_subcommand() -> None:
    assert {"simulator", "stream", "trainer", "dashboard", "mlflow"} <= set(APP_SERVICES)
    parser = build_parser()
    for name, service in APP_SERVICES.items():
        args = parser.parse_args(service["command"])  # exits (fails the test) on an unknown subcommand
        assert args.command == service["command"][0], name


def test_volumes_and_state_directory_agree() -> None:
    declared = set(COMPOSE["volumes"])
    for name, service in COMPOSE["services"].items():
        for mount in service.get("volumes", []):
            volume, target = mount.split(":")[:2]
            assert volume in declared, f"{name} mounts undeclared volume {volume}"
            if name in APP_SERVICES:
                assert target == service["environment"]["IOTMON_HOME"]


def test_app_reaches_the_compose_broker() -> None:
    kafka = COMPOSE["services"]["kafka"]["environment"]
    advertised = re.search(r"PLAINTEXT://([^,]+)", kafka["KAFKA_ADVERTISED_LISTENERS"]).group(1)
    for service in APP_SERVICES.values():
        assert service["environment"]["IOTMON_KAFKA_BOOTSTRAP"] == advertised
        assert service["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_dockerfile_installs_the_way_the_readme_does() -> None:
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    readme = (PROJECT_ROOT / "README.md").read_text()
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert "make demo" in readme and "make test" in readme
    assert re.search(r"^demo: setup$", makefile, re.M) and re.search(r"^test: setup", makefile, re.M)
    assert re.search(r"^RUN make setup\b", dockerfile, re.M)
    assert 'ENTRYPOINT ["iotmon"]' in dockerfile
    assert Path(PROJECT_ROOT / ".dockerignore").read_text().count("var/") == 1


def test_web_services_publish_their_port_on_loopback_only() -> None:
    parser = build_parser()
    for name in ("dashboard", "mlflow"):
        service = APP_SERVICES[name]
        args = parser.parse_args(service["command"])
        assert args.host == "0.0.0.0", f"{name} must listen beyond the container's own loopback"
        (mapping,) = service["ports"]
        host_ip, host_port, container_port = mapping.split(":")
        assert host_ip == "127.0.0.1", f"{name} is published to this machine only"
        assert int(container_port) == args.port and int(host_port) == args.port


def test_only_the_web_uis_are_published_and_the_broker_listens_inside_the_network() -> None:
    published = {name for name, service in COMPOSE["services"].items() if service.get("ports")}
    assert published == {"dashboard", "mlflow"}
    kafka = COMPOSE["services"]["kafka"]["environment"]
    # Every address inside its container (an empty host), stated explicitly, so the app containers reach it.
    assert all(listener.split("://")[1].startswith(":") for listener in kafka["KAFKA_LISTENERS"].split(","))
