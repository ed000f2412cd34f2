"""Renderings for operators: a ``docker run`` line and a Kubernetes LeaderWorkerSet manifest.

Both wrap exactly the argv :meth:`ServeConfig.to_argv` renders, so what the
rules and vLLM's parser checked is what the container runs:

* ``docker``: one ``docker run`` per node with vLLM's image (its entrypoint is
  ``vllm serve``; the words after the image are the rendered argv).  A node
  with setup lines (a Ray head or worker) runs them in the container first,
  through ``/bin/sh -c``, then ``exec vllm serve``.  Roles of a single-node
  split that run no vLLM (the router) are host commands.
* ``k8s``: a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``): one group of
  pods per replica, the head node as the leader, the others as workers, each
  pod holding one node's GPUs.  A preset's required data-parallel address
  becomes ``$(LWS_LEADER_ADDRESS)``, which LeaderWorkerSet puts in every
  pod's environment; the leader has ``/health`` readiness and a start-up
  probe as long as vLLM's engine start-up timeout.  Like the docker line,
  every pod gets ``HF_TOKEN`` (from an optional Secret) and a Hugging Face
  cache that outlives the pod (a host folder on each node).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any

import yaml

from dsv4_presets.configs import PresetError, ServeConfig

__all__ = [
    "DEFAULT_STARTUP_S",
    "LWS_LEADER_ADDRESS",
    "default_image",
    "docker_command",
    "k8s_manifest",
    "render_docker",
    "render_k8s",
    "with_leader_address",
]

LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
# vLLM waits this long for its engines by default (VLLM_ENGINE_READY_TIMEOUT_S, vllm/envs.py).
DEFAULT_STARTUP_S = 600
API_PORT = 8000
_HF_CACHE = "/root/.cache/huggingface"
# k8s: the token comes from this Secret (optional, for gated models) and the
# model cache lives on each node under this host folder, as the docker line's
# `-e HF_TOKEN -v $HOME/.cache/huggingface:...` does for one host.
HF_TOKEN_SECRET = "hf-token"
HF_TOKEN_SECRET_KEY = "token"
K8S_HF_CACHE_HOST_PATH = "/var/cache/huggingface"


def default_image(config: ServeConfig) -> str:
    """vLLM's published image for the preset's vendor at its minimum vLLM version."""
    tag = f"v{config.min_vllm}" if config.min_vllm else "latest"
    if str(config.hardware.get("vendor", "nvidia")).lower() == "amd":
        return f"vllm/vllm-openai-rocm:{tag}"
    return f"vllm/vllm-openai:{tag}"


def _is_amd(config: ServeConfig) -> bool:
    return str(config.hardware.get("vendor", "nvidia")).lower() == "amd"


def _device_flags(config: ServeConfig) -> list[str]:
    if _is_amd(config):
        return [
            "--device",
            "/dev/kfd",
            "--device",
            "/dev/dri",
            "--group-add",
            "video",
            "--security-opt",
            "seccomp=unconfined",
        ]
    return ["--gpus", "all"]


def _script(config: ServeConfig, *, prelude: tuple[str, ...] = ()) -> str:
    """Setup lines, then ``exec vllm serve ARGV`` when the node serves."""
    lines = [*prelude, *config.setup_lines()]
    spec = config.node_spec
    if spec is None or spec.serve:
        lines.append(shlex.join(["exec", "vllm", "serve", *config.to_argv()]))
    return " && ".join(lines)


def docker_command(config: ServeConfig, *, image: str | None = None) -> list[str]:
    """The ``docker run`` words for one node of a preset (see the module docstring)."""
    image = image or default_image(config)
    words = ["docker", "run", "--rm", "--ipc=host", *_device_flags(config)]
    if config.nodes:
        words.append("--network=host")  # ranks and roles reach each other by host address
    else:
        port = str(config.args.get("port", API_PORT))
        words += ["-p", f"{port}:{port}"]
    words += ["-v", f"$HOME/.cache/huggingface:{_HF_CACHE}", "-e", "HF_TOKEN"]
    for key, value in config.env_strings().items():
        words += ["-e", f"{key}={value}"]
    for name in sorted(set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", " ".join(config.setup_lines())))):
        words += ["-e", name]  # passed through from the host (RAY_HEAD_IP)
    if config.setup_lines():
        return [*words, "--entrypoint", "/bin/sh", image, "-c", _script(config)]
    return [*words, image, *config.to_argv()]


def _shell(words: list[str]) -> str:
    """``docker run`` as a shell line; ``$HOME`` stays for the shell to expand."""
    out = []
    for word in words:
        quoted = shlex.quote(word)
        if word.startswith("$HOME/"):
            quoted = '"$HOME"' + shlex.quote(word[len("$HOME") :])
        out.append(quoted)
    return " ".join(out)


def render_docker(
    config: ServeConfig, *, image: str | None = None, only_this_node: bool = False
) -> str:
    """Every node's ``docker run`` line, or only ``config``'s node with ``only_this_node``."""
    blocks = []
    for target in [config] if only_this_node else config.all_nodes():
        spec = target.node_spec
        lines = []
        if spec is not None and len(config.nodes) > 1:
            lines.append(f"# node {spec.name}: {spec.description}".rstrip(": "))
        if spec is not None and not spec.serve and config.same_host:
            lines += target.setup_lines()  # a host process (the router), not vLLM's image
        else:
            lines.append(_shell(docker_command(target, image=image)))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def with_leader_address(config: ServeConfig) -> ServeConfig:
    """The preset with a required, unset data-parallel address set to the LWS leader's.

    Applied as a ``--set`` override, so it holds on every node.
    """
    if "data-parallel-address" not in config.required or config.args.get("data-parallel-address"):
        return config
    override = (("data-parallel-address",), LWS_LEADER_ADDRESS)
    return dataclasses.replace(config, overrides=(*config.overrides, override)).for_node(
        config.node
    )


def _probe(port: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 10}


def _container(config: ServeConfig, image: str, *, leader: bool) -> dict[str, Any]:
    gpus = int(config.hardware.get("gpus_per_node") or 8)
    token = {
        "name": "HF_TOKEN",
        "valueFrom": {
            "secretKeyRef": {
                "name": HF_TOKEN_SECRET,
                "key": HF_TOKEN_SECRET_KEY,
                "optional": True,
            }
        },
    }
    env = [token, *({"name": k, "value": v} for k, v in config.env_strings().items())]
    container: dict[str, Any] = {"name": "vllm", "image": image}
    if config.setup_lines():
        prelude: tuple[str, ...] = ()
        if any("RAY_HEAD_IP" in line for line in config.setup_lines()):
            prelude = ('export RAY_HEAD_IP="${RAY_HEAD_IP:-$LWS_LEADER_ADDRESS}"',)
        container["command"] = ["/bin/sh", "-c", _script(config, prelude=prelude)]
    else:
        container["command"] = ["vllm", "serve"]
        container["args"] = config.to_argv()
    container["env"] = env
    resource = "amd.com/gpu" if _is_amd(config) else "nvidia.com/gpu"
    container["resources"] = {"limits": {resource: gpus}}
    container["volumeMounts"] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "hf-cache", "mountPath": _HF_CACHE},
    ]
    spec = config.node_spec
    if leader and (spec is None or spec.serve) and not config.args.get("headless"):
        startup = int(config.env.get("VLLM_ENGINE_READY_TIMEOUT_S", DEFAULT_STARTUP_S))
        port = int(config.args.get("port", API_PORT))
        container["ports"] = [{"containerPort": port, "name": "http"}]
        container["readinessProbe"] = _probe(port)
        # Model download and load, compilation and CUDA graphs come before /health:
        # give the engine its whole start-up timeout plus a margin.
        container["startupProbe"] = {**_probe(port), "failureThreshold": startup // 10 + 30}
    return container


def _pod(config: ServeConfig, image: str, *, leader: bool, role: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app.kubernetes.io/name": "dsv4", "dsv4/role": role}},
        "spec": {
            "containers": [_container(config, image, leader=leader)],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {
                    "name": "hf-cache",
                    "hostPath": {"path": K8S_HF_CACHE_HOST_PATH, "type": "DirectoryOrCreate"},
                },
            ],
        },
    }


def k8s_manifest(config: ServeConfig, *, image: str | None = None) -> dict[str, Any]:
    """A LeaderWorkerSet for the whole preset (all nodes), as a mapping."""
    if config.same_host:
        raise PresetError(
            f"preset {config.name!r} runs several roles on one node; a LeaderWorkerSet puts "
            "each node in its own pod: render its roles with --format docker instead"
        )
    image = image or default_image(config)
    targets = with_leader_address(config).all_nodes()
    workers = targets[1:]
    if len({tuple(w.to_argv()) for w in workers}) > 1:
        raise PresetError(
            f"preset {config.name!r}: a LeaderWorkerSet has one worker template, but the "
            "preset's worker nodes differ"
        )
    template: dict[str, Any] = {"size": len(targets), "restartPolicy": "RecreateGroupOnPodRestart"}
    if workers:
        template["leaderTemplate"] = _pod(targets[0], image, leader=True, role="leader")
        template["workerTemplate"] = _pod(workers[0], image, leader=False, role="worker")
    else:
        template["workerTemplate"] = _pod(targets[0], image, leader=True, role="leader")
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": f"dsv4-{config.name}".lower()[:63]},
        "spec": {"replicas": 1, "leaderWorkerTemplate": template},
    }


def render_k8s(config: ServeConfig, *, image: str | None = None) -> str:
    """:func:`k8s_manifest` as YAML, with a header saying what it needs."""
    header = (
        f"# dsv4 preset {config.name}: a LeaderWorkerSet (needs the LWS controller:\n"
        "# https://github.com/kubernetes-sigs/lws). Apply with: kubectl apply -f this.yaml\n"
        f"# HF_TOKEN comes from the Secret {HF_TOKEN_SECRET!r} (key {HF_TOKEN_SECRET_KEY!r}; "
        "optional, for gated models):\n"
        f"#   kubectl create secret generic {HF_TOKEN_SECRET} "
        f'--from-literal={HF_TOKEN_SECRET_KEY}="$HF_TOKEN"\n'
        f"# The model cache is {K8S_HF_CACHE_HOST_PATH} on each node (hostPath), "
        f"mounted at {_HF_CACHE}.\n"
    )
    manifest = k8s_manifest(config, image=image)
    return header + yaml.safe_dump(manifest, sort_keys=False, width=100)
