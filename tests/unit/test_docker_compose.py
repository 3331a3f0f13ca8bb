"""docker-compose.yml cannot run here (no Docker engine), so check what can be checked without one."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from iotmon.cli import build_parser
from tests.support import PROJECT_ROOT

COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
APP_SERVICES = {name: svc for name, svc in COMPOSE["services"].items() if svc.get("image", "").startswith("iotmon")}
# What the demo runs: `docker compose up demo` must bring up all of it.
DEMO_PARTS = {"kafka", "simulator", "mlflow", "stream", "trainer", "dashboard"}


def dependencies(service: dict) -> dict[str, str]:
    """A service's depends_on as {service: condition}; the short (list) syntax means service_started."""
    declared = service.get("depends_on", {})
    if isinstance(declared, list):
        return dict.fromkeys(declared, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in declared.items()}


def brought_up_by(name: str) -> set[str]:
    """Every service `docker compose up <name>` starts besides <name>: its dependencies, transitively."""
    reached: set[str] = set()
    todo = [name]
    while todo:
        for dependency in dependencies(COMPOSE["services"][todo.pop()]):
            if dependency not in reached:
                reached.add(dependency)
                todo.append(dependency)
    return reached - {name}


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


def test_docker_compose_up_demo_starts_the_whole_demo() -> None:
    services = COMPOSE["services"]
    assert "demo" in services, "`docker compose up demo` names a service"
    # Every other service, the one that builds the image included; nothing is left for a second command.
    assert brought_up_by("demo") == set(services) - {"demo"} >= DEMO_PARTS
    assert any("build" in services[name] for name in brought_up_by("demo"))
    # The entry point, not a part: nothing depends on it, and no profile hides it from `up` or `down`.
    assert all("demo" not in dependencies(service) for service in services.values())
    assert "profiles" not in services["demo"]
    # It waits for each part that can say it is ready, then reports: `iotmon status` exits 0 once the stream runs.
    for name, condition in dependencies(services["demo"]).items():
        assert condition == ("service_healthy" if "healthcheck" in services[name] else "service_started"), name
    assert {"kafka", "stream", "dashboard", "mlflow"} <= {
        name for name, condition in dependencies(services["demo"]).items() if condition == "service_healthy"
    }
    assert build_parser().parse_args(services["demo"]["command"]).command == "status"
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert "`docker compose up demo`" in readme


def test_healthchecks_ask_the_right_process() -> None:
    parser = build_parser()
    check = APP_SERVICES["stream"]["healthcheck"]["test"]
    assert check[:2] == ["CMD", "iotmon"] and parser.parse_args(check[2:]).command == "status"
    for name in ("dashboard", "mlflow"):
        args = parser.parse_args(APP_SERVICES[name]["command"])
        assert f"//localhost:{args.port}/" in " ".join(APP_SERVICES[name]["healthcheck"]["test"]), name


def test_the_trainer_weighs_less_than_the_stream() -> None:
    """Containers share the cores as cgroups, before the threads in them: the trainer's policy cannot reach across."""
    default = 1024  # Docker's cpu_shares when none is set
    services = COMPOSE["services"]
    assert services["trainer"].get("cpu_shares", default) < services["stream"].get("cpu_shares", default) / 10
