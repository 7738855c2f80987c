"""deploy/rayservice.yaml, validated offline: against KubeRay's RayService CRD schema (vendored, see
fixtures/README.md) in place of `kubectl apply --dry-run`, its serveConfigV2 against Ray Serve's own
config schema, and its application args against `llmpipe serve`'s options and `build_app`."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "rayservice.yaml"
SCHEMA = Path(__file__).parent / "fixtures" / "rayservice_crd_schema.json"
IMPORT_PATH = "llmpipe.deploy.ray:build_app"


def manifest() -> dict:
    (doc,) = yaml.safe_load_all(MANIFEST.read_text())
    return doc


def strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused where the API server would prune them (objects with
    properties and no additionalProperties / x-kubernetes-preserve-unknown-fields): a misspelt or
    misplaced field fails here, as `kubectl apply --validate=strict` fails it."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = strict(json.loads(SCHEMA.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def app_args(doc: dict) -> dict:
    (app,) = serve_config(doc)["applications"]
    return app["args"]


def test_manifest_is_a_valid_rayservice(validator):
    doc = manifest()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    assert errors(validator, doc) == []


def test_the_validator_refuses_broken_manifests(validator):
    """The check bites: a missing required field, a wrong type, a misspelt field."""
    missing, wrong_type, misspelt = manifest(), manifest(), manifest()
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    misspelt["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    for doc in (missing, wrong_type, misspelt):
        assert errors(validator, doc), doc


def test_serve_config_is_one_llmpipe_application():
    doc = manifest()
    (app,) = serve_config(doc)["applications"]
    assert app["import_path"] == IMPORT_PATH and app["route_prefix"] == "/"
    args = app["args"]
    assert args["data_parallel_size"] == 2 and args["routing"] == "prefix"
    assert {"model", "num_threads"} <= set(args)
    # one engine replica per worker pod, each pod's CPUs covering its replica's threads
    workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert sum(group["replicas"] for group in workers) == args["data_parallel_size"]
    for group in workers:
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["cpu"]) > args["num_threads"]


def test_serve_config_passes_ray_serves_own_schema():
    schema = pytest.importorskip("ray.serve.schema", reason="ray[serve] is not installed (pip install llmpipe[ray])")
    config = schema.ServeDeploySchema.model_validate(serve_config(manifest()))
    assert [app.import_path for app in config.applications] == [IMPORT_PATH]


def gpu_variant(doc: dict) -> dict:
    """The manifest with its commented GPU changes made: one GPU per replica and per worker pod."""
    doc = copy.deepcopy(doc)
    config = serve_config(doc)
    (app,) = config["applications"]
    app["args"].update(device="cuda", num_threads=1)
    app["deployments"] = [{"name": f"llmpipe-replica-{i}", "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}}
                          for i in range(app["args"]["data_parallel_size"])]
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        group["groupName"] = "gpu-workers"
        (container,) = group["template"]["spec"]["containers"]
        container["resources"]["limits"]["nvidia.com/gpu"] = 1
        group["template"]["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return doc


def test_the_commented_gpu_variant_is_valid_too(validator):
    doc = gpu_variant(manifest())
    assert errors(validator, doc) == []
    schema = pytest.importorskip("ray.serve.schema", reason="ray[serve] is not installed (pip install llmpipe[ray])")
    (app,) = schema.ServeDeploySchema.model_validate(serve_config(doc)).applications
    assert [d.ray_actor_options.num_gpus for d in app.deployments] == [1, 1]


def serve_parser() -> argparse.ArgumentParser:
    from llmpipe.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def test_args_are_llmpipe_serve_options():
    """Every arg is a `llmpipe serve` option by its dest name, and its value parses as that flag's."""
    parser = serve_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    assert "data_parallel_size" in actions
    args = app_args(manifest())
    assert set(args) <= set(actions), f"not `llmpipe serve` options: {sorted(set(args) - set(actions))}"
    argv = []
    for key, value in args.items():
        action = actions[key]
        if value is None:
            assert action.default is None, key
        elif action.nargs == 0:  # a switch
            argv.append(action.option_strings[0 if value else -1])
        else:
            argv += [action.option_strings[0], str(value)]
    parsed = parser.parse_args(argv)
    assert {key: getattr(parsed, key) for key in args} == args


def test_build_app_takes_the_args():
    ray_app = importlib.import_module("llmpipe.deploy.ray")  # ray[serve] is a test dependency
    from ray.serve import Application

    assert isinstance(ray_app.build_app(dict(app_args(manifest()))), Application)
