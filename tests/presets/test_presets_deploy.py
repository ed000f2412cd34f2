"""`dsv4 render --format docker|k8s`: what the container runs is exactly the rendered argv."""

from __future__ import annotations

import shlex

import pytest
import yaml

from dsv4_presets import resolve_serve
from dsv4_presets.cli import main
from dsv4_presets.deploy import LWS_LEADER_ADDRESS, default_image, docker_command, k8s_manifest
from dsv4_presets.presets import serve_preset_names

ADDR = "data-parallel-address=10.0.0.1"


def _sets(name: str) -> list[str]:
    return [ADDR] if name == "dp16-ep-2node" else []


def _set_flags(name: str) -> list[str]:
    return [word for item in _sets(name) for word in ("--set", item)]


def _container_argv(words: list[str], image: str) -> list[str]:
    """What ``vllm serve`` receives inside a ``docker run`` (either form)."""
    after = words[words.index(image) + 1 :]
    if "--entrypoint" not in words:
        return after
    assert after[0] == "-c"
    script = after[1]
    last = script.split(" && ")[-1]
    words = shlex.split(last)
    assert words[:3] == ["exec", "vllm", "serve"], script
    return words[3:]


@pytest.mark.parametrize("name", serve_preset_names())
def test_docker_line_runs_the_rendered_argv(name, capsys):
    config = resolve_serve(name, sets=_sets(name))
    assert main(["render", name, "--format", "docker", *_set_flags(name)]) == 0
    out = capsys.readouterr().out
    blocks = [b for b in out.strip().split("\n\n") if b]
    targets = config.all_nodes()
    assert len(blocks) == len(targets)
    image = default_image(config)
    for block, target in zip(blocks, targets, strict=True):
        lines = [line for line in block.splitlines() if not line.startswith("#")]
        spec = target.node_spec
        if spec is not None and not spec.serve and config.same_host:
            assert lines == target.setup_lines()  # the router runs on the host
            continue
        words = shlex.split(lines[0])
        assert words == docker_command(target) or words[:2] == ["docker", "run"]
        assert words[:2] == ["docker", "run"] and image in words
        for key, value in target.env_strings().items():
            assert f"{key}={value}" in words
        if spec is None or spec.serve:
            assert _container_argv(words, image) == target.to_argv()
        else:
            assert "exec vllm serve" not in words[-1]
        if config.hardware.get("vendor") == "amd":
            assert "/dev/kfd" in words and "--gpus" not in words
        else:
            assert words[words.index("--gpus") + 1] == "all"


def test_docker_single_node_publishes_the_api_port_and_the_image_follows_min_vllm():
    config = resolve_serve("h200-tp8-ep")
    words = docker_command(config)
    assert words[words.index("-p") + 1] == "8000:8000"
    assert default_image(config) == f"vllm/vllm-openai:v{config.min_vllm}"
    assert default_image(resolve_serve("mi355x-tp8-ep")).startswith("vllm/vllm-openai-rocm:")
    assert docker_command(config, image="my/vllm:1")[-len(config.to_argv()) - 1] == "my/vllm:1"


@pytest.mark.parametrize(
    "name", [n for n in serve_preset_names() if not resolve_serve(n, sets=_sets(n)).same_host]
)
def test_k8s_manifest_parses_and_runs_the_rendered_argv(name, capsys):
    assert main(["render", name, "--format", "k8s"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert manifest["kind"] == "LeaderWorkerSet"
    template = manifest["spec"]["leaderWorkerTemplate"]
    config = resolve_serve(name)
    if "data-parallel-address" in config.required:
        config = resolve_serve(name, sets=[f"data-parallel-address={LWS_LEADER_ADDRESS}"])
    targets = config.all_nodes()
    assert template["size"] == len(targets)
    pods = [template.get("leaderTemplate", template["workerTemplate"]), template["workerTemplate"]]
    gpus = config.hardware["gpus_per_node"]
    for pod, target in zip(pods, [targets[0], targets[-1]], strict=True):
        (container,) = pod["spec"]["containers"]
        if container["command"][:2] == ["vllm", "serve"]:
            assert container["args"] == target.to_argv()
        else:
            assert container["command"][:2] == ["/bin/sh", "-c"]
            script = container["command"][2]
            assert set(target.setup_lines()) <= set(script.split(" && "))
            if target.node_spec is None or target.node_spec.serve:
                assert shlex.split(script.split(" && ")[-1])[3:] == target.to_argv()
        limits = container["resources"]["limits"]
        assert limits == {"amd.com/gpu" if "mi355x" in name else "nvidia.com/gpu": gpus}
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert env == target.env_strings()
        # Like the docker line's `-e HF_TOKEN -v $HOME/.cache/huggingface:...`.
        (token,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
        ref = token["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref["optional"]) == ("hf-token", "token", True)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["hf-cache"] == "/root/.cache/huggingface"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["hf-cache"]["hostPath"]["path"] == "/var/cache/huggingface"
        assert set(mounts) == set(volumes)
    leader = pods[0]["spec"]["containers"][0]
    if not targets[0].args.get("headless"):
        assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
        startup = leader["startupProbe"]
        timeout = int(targets[0].env.get("VLLM_ENGINE_READY_TIMEOUT_S", 600))
        assert startup["failureThreshold"] * startup["periodSeconds"] >= timeout


def test_k8s_fills_the_head_address_from_leaderworkerset():
    manifest = k8s_manifest(resolve_serve("dp16-ep-2node"))
    template = manifest["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        args = template[role]["spec"]["containers"][0]["args"]
        assert args[args.index("--data-parallel-address") + 1] == "$(LWS_LEADER_ADDRESS)"
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert "--headless" in worker["args"] and "readinessProbe" not in worker


def test_k8s_refuses_roles_sharing_a_node(capsys):
    assert main(["render", "h200-pd-nixl", "--format", "k8s"]) == 2
    assert "--format docker" in capsys.readouterr().err
    assert main(["render", "random-1024-64", "--format", "docker"]) == 2
