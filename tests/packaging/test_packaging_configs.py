"""Packaging configs: the conda recipe, pixi.toml and the cibuildwheel settings.

Each is validated against its official schema (copies in ci/schemas/; cibuildwheel's
ships inside its package), then checked for what the schema can't say: the matrix the
recipe renders to, the environments pixi defines, the wheels cibuildwheel would build.
Every check is a function returning its problems, so the mutation tests at the end can
show it failing on a broken config.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "ci" / "schemas"
PLUGINS = ("attention", "elementwise", "fp8")
CUDA = ("12.4", "13.0")
CONDA_PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
WHEEL_PYTHONS = ("310", "311", "312", "313", "314", "315")


@cache
def _schema(name: str) -> dict:
    if name == "cibuildwheel":
        import cibuildwheel

        path = Path(cibuildwheel.__file__).parent / "resources" / "cibuildwheel.schema.json"
    else:
        path = SCHEMAS / name
    return json.loads(path.read_text())


def schema_errors(instance: object, schema_name: str) -> list[str]:
    schema = _schema(schema_name)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    problems = []
    for error in validator.iter_errors(instance):
        # under anyOf/oneOf (single- vs multi-output recipes) the deepest sub-error says where
        leaves, todo = [], [error]
        while todo:
            e = todo.pop()
            (todo.extend(e.context) if e.context else leaves.append(e))
        deepest = max(leaves, key=lambda e: len(e.absolute_path))
        problems.append(f"{'/'.join(map(str, deepest.absolute_path)) or '<root>'}: {deepest.message[:200]}")
    return problems


def load_recipe() -> dict:
    return yaml.safe_load((ROOT / "recipe" / "recipe.yaml").read_text())


def load_pixi() -> dict:
    return tomllib.loads((ROOT / "pixi.toml").read_text())


def load_cibw() -> dict:
    return tomllib.loads((ROOT / "ci" / "cibuildwheel.toml").read_text())


# -- the recipe ----------------------------------------------------------------------


def recipe_problems(recipe: dict) -> list[str]:
    problems = schema_errors(recipe, "rattler-build-recipe-v1.schema.json")
    if recipe.get("schema_version") != 1:
        problems.append("schema_version must be 1")
    outputs = {o["package"]["name"]: o for o in recipe.get("outputs", [])}
    core = outputs.get("astrai", {})
    if core.get("build", {}).get("noarch") != "python":
        problems.append("the core output 'astrai' must be noarch: python")
    for plugin in PLUGINS:
        name = f"astrai-{plugin}"
        out = outputs.get(name)
        if out is None:
            problems.append(f"no output {name}")
            continue
        req = out.get("requirements", {})
        build = " ".join(map(str, req.get("build", [])))
        for needed in ("compiler('cuda')", "stdlib('c')"):
            if needed not in build:
                problems.append(f"{name}: build requirements lack ${{{{ {needed} }}}}")
        run = " ".join(map(str, req.get("run", [])))
        if "__cuda" not in run or "cuda-version" not in run:
            problems.append(f"{name}: run requirements must constrain __cuda and cuda-version")
        if f"./packages/{name}" not in json.dumps(out.get("build", {})):
            problems.append(f"{name}: the build script does not install ./packages/{name}")
        tests = json.dumps(out.get("tests", []))
        if "ci/wheel-tests" not in tests or f"astrai_{plugin}" not in tests:
            problems.append(f"{name}: tests must import astrai_{plugin} and run ci/wheel-tests")
    return problems


@cache
def rendered() -> tuple:
    sys.path.insert(0, str(ROOT / "ci"))
    from conda_channel import render_recipe

    return tuple(render_recipe("linux-64"))


def render_problems(outputs) -> list[str]:
    problems = []
    names = sorted({o.name for o in outputs})
    if names != sorted(["astrai", "astrai-kernels", *(f"astrai-{p}" for p in PLUGINS)]):
        problems.append(f"outputs {names}")
    core = [o for o in outputs if o.name == "astrai"]
    if len(core) != 1 or core[0].noarch != "python":
        problems.append(f"the core must render once, noarch: python; got {[(o.build_string, o.noarch) for o in core]}")
    for plugin in PLUGINS:
        builds = [o for o in outputs if o.name == f"astrai-{plugin}"]
        matrix = sorted((o.cuda, o.python) for o in builds)
        want = sorted((c, p) for c in CUDA for p in CONDA_PYTHONS)
        if matrix != want:
            problems.append(f"astrai-{plugin} renders (CUDA, Python) {matrix}, want {want}")
        for o in builds:
            major = o.cuda.split(".")[0]
            tag = "cu" + o.cuda.replace(".", "")
            if not o.build_string.startswith(f"{tag}_py{o.python.replace('.', '')}"):
                problems.append(f"{o.name} {o.cuda}: build string {o.build_string} does not start with {tag}_py")
            for dep in (f"__cuda >={major}", f"cuda-version >={o.cuda},<{int(major) + 1}"):
                if dep not in o.depends:
                    problems.append(f"{o.name} {o.build_string}: run requirements {o.depends} lack {dep!r}")
        if len({o.build_string for o in builds}) != len(builds):
            problems.append(f"astrai-{plugin}: build strings are not unique")
    return problems


def test_recipe_matches_the_official_schema_and_the_plan():
    assert recipe_problems(load_recipe()) == []


def test_recipe_renders_the_matrix_of_the_variants_file():
    assert render_problems(rendered()) == []


def test_recipe_pins_the_compilers_per_cuda_version():
    for o in rendered():
        if o.cuda is None:
            continue
        # render_recipe keeps run requirements; the variant says which toolchain built it
        assert o.variant["cuda_compiler"] == "cuda-nvcc"
        assert o.variant["c_stdlib"] == "sysroot" and o.variant["c_stdlib_version"] == "2.28"
        assert int(o.variant["cxx_compiler_version"]) <= (13 if o.cuda.startswith("12.") else 15)


def test_doctor_names_packages_the_recipe_builds():
    from astrai.cli.install_hint import EXTRAS, conda_package

    names = {o.name for o in rendered()}
    assert {conda_package(extra) for extra in EXTRAS} <= names
    assert "astrai" in names


# -- pixi ----------------------------------------------------------------------------


def pixi_problems(manifest: dict) -> list[str]:
    problems = schema_errors(manifest, "pixi-manifest-v0.77.0.schema.json")
    features = manifest.get("feature", {})
    envs = manifest.get("environments", {})
    for major, cuda in (("12", "12.4"), ("13", "13.0")):
        name = f"cu{major}"
        feature = features.get(name, {})
        if str(feature.get("system-requirements", {}).get("cuda", "")).split(".")[0] != major:
            problems.append(f"feature {name}: system-requirements cuda must be {major}.x")
        if feature.get("dependencies", {}).get("cuda-version") != f"{cuda}.*":
            problems.append(f"feature {name}: cuda-version must be pinned to {cuda}.*")
        env = envs.get(name)
        env_features = env if isinstance(env, list) else (env or {}).get("features", [])
        if name not in env_features:
            problems.append(f"environment {name} must use feature {name}")
    tasks = set(manifest.get("tasks", {}))
    for feature in features.values():
        tasks |= set(feature.get("tasks", {}))
    for task in ("build", "test", "bench", "doctor"):
        if task not in tasks:
            problems.append(f"no task {task!r}")
    return problems


def test_pixi_manifest_matches_the_official_schema_and_the_plan():
    assert pixi_problems(load_pixi()) == []


def test_pixi_cuda_versions_are_the_recipes():
    pixi = load_pixi()["feature"]
    assert sorted(pixi[f"cu{c.split('.')[0]}"]["dependencies"]["cuda-version"] for c in CUDA) == \
        sorted(f"{c}.*" for c in {o.cuda for o in rendered() if o.cuda})


# -- cibuildwheel --------------------------------------------------------------------


def intended_identifiers() -> list[str]:
    return [f"cp{py}-manylinux_{arch}" for arch in ("x86_64", "aarch64") for py in WHEEL_PYTHONS]


def cibw_problems(config: dict) -> list[str]:
    table = config.get("tool", {}).get("cibuildwheel", {})
    problems = schema_errors(table, "cibuildwheel")
    for key in ("before-all", "test-command", "repair-wheel-command"):
        if not table.get(key):
            problems.append(f"{key} is not set")
    if "auditwheel repair" not in table.get("repair-wheel-command", ""):
        problems.append("the wheels must be repaired with auditwheel")
    if "ci/wheel-tests" not in table.get("test-command", ""):
        problems.append("test-command must run ci/wheel-tests against the installed wheel")
    if "ASTRAI_CUDA_ARCHS" not in table.get("environment-pass", []):
        problems.append("ASTRAI_CUDA_ARCHS must pass into the container (per-arch builds)")
    for arch in ("x86_64", "aarch64"):
        if table.get(f"manylinux-{arch}-image") != "manylinux_2_28":
            problems.append(f"manylinux-{arch}-image must be manylinux_2_28")
    return problems


def print_identifiers(config_file: Path, package: Path) -> list[str]:
    env = dict(os.environ, ASTRAI_CUDA="13.0")
    out = subprocess.run([sys.executable, "-m", "cibuildwheel", "--platform", "linux", "--config-file",
                          str(config_file), "--print-build-identifiers", str(package)],
                         capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


def test_cibuildwheel_config_matches_its_bundled_schema_and_the_plan():
    assert cibw_problems(load_cibw()) == []
    before_all = ROOT / "ci" / "cibw" / "install-cuda"
    assert before_all.is_file() and os.access(before_all, os.X_OK)


def test_cibuildwheel_environment_is_what_the_container_gets():
    from cibuildwheel.environment import parse_environment

    table = load_cibw()["tool"]["cibuildwheel"]["linux"]["environment"]
    parsed = parse_environment(" ".join(f'{k}="{v}"' for k, v in table.items()))
    env = parsed.as_dictionary(prev_environment={"PATH": "/usr/bin"}, executor=None)
    assert env["CUDACXX"] == "/usr/local/cuda/bin/nvcc" and env["PATH"].startswith("/usr/local/cuda/bin:")
    # install-cuda creates the host compiler link the environment names
    assert "/usr/local/cuda/host-cxx/g++" in (ROOT / "ci" / "cibw" / "install-cuda").read_text()
    assert env["CUDAHOSTCXX"] == "/usr/local/cuda/host-cxx/g++"


@pytest.mark.parametrize("plugin", PLUGINS)
def test_cibuildwheel_lists_the_intended_builds(plugin):
    ids = print_identifiers(ROOT / "ci" / "cibuildwheel.toml", ROOT / "packages" / f"astrai-{plugin}")
    assert ids == intended_identifiers()


# -- the checks fail on broken configs ----------------------------------------------


def _set(data: dict, path: str, value) -> dict:
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is KeyError:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


@pytest.mark.parametrize("path, value, says", [
    ("schema_version", 2, "schema_version"),
    ("outputs.0.build.noarch", "pure", "outputs/0/build"),
    ("outputs.1.requirements.runn", ["python"], "outputs/1"),
    ("outputs.1.requirements.run", ["python"], "__cuda"),
    ("outputs.0.build.noarch", KeyError, "noarch: python"),
])
def test_a_broken_recipe_is_caught(path, value, says):
    problems = recipe_problems(_set(load_recipe(), path, value))
    assert any(says in p for p in problems), problems


def test_a_recipe_that_renders_the_wrong_matrix_is_caught(tmp_path):
    sys.path.insert(0, str(ROOT / "ci"))
    import conda_channel

    broken = (ROOT / "recipe" / "recipe.yaml").read_text().replace("- __cuda >=", "- __cuda_typo >=", 1)
    variants = (ROOT / "recipe" / "variants.yaml").read_text().replace('  - "3.14"\n', "")
    (tmp_path / "recipe.yaml").write_text(broken)
    (tmp_path / "variants.yaml").write_text(variants)
    saved = conda_channel.RECIPE, conda_channel.VARIANTS
    conda_channel.RECIPE, conda_channel.VARIANTS = tmp_path / "recipe.yaml", tmp_path / "variants.yaml"
    try:
        problems = render_problems(conda_channel.render_recipe("linux-64"))
    finally:
        conda_channel.RECIPE, conda_channel.VARIANTS = saved
    assert any("want" in p for p in problems), problems  # Python 3.14 missing
    assert any("lack '__cuda >=12'" in p for p in problems), problems


@pytest.mark.parametrize("path, value, says", [
    ("workspace.platforms", "linux-64", "workspace/platforms"),
    ("feature.cu12.system-requirements.cuda", "13.0", "system-requirements cuda must be 12"),
    ("feature.cu13.dependencies.cuda-version", "12.4.*", "pinned to 13.0"),
    ("tasks.doctor", KeyError, "no task 'doctor'"),
    ("environments.cu12", {"feature": ["cu12"]}, "environments/cu12"),
])
def test_a_broken_pixi_manifest_is_caught(path, value, says):
    problems = pixi_problems(_set(load_pixi(), path, value))
    assert any(says in p for p in problems), problems


@pytest.mark.parametrize("path, value, says", [
    ("tool.cibuildwheel.before-alll", "x", "before-alll"),
    ("tool.cibuildwheel.build-frontend", "poetry", "build-frontend"),
    ("tool.cibuildwheel.environment-pass", ["ASTRAI_CUDA"], "ASTRAI_CUDA_ARCHS"),
    ("tool.cibuildwheel.manylinux-aarch64-image", "manylinux2014", "manylinux_2_28"),
    ("tool.cibuildwheel.test-command", "pytest", "ci/wheel-tests"),
])
def test_a_broken_cibuildwheel_config_is_caught(path, value, says):
    problems = cibw_problems(_set(load_cibw(), path, value))
    assert any(says in p for p in problems), problems


def test_cibuildwheel_identifiers_catch_a_wrong_build_selector(tmp_path):
    text = (ROOT / "ci" / "cibuildwheel.toml").read_text()
    broken = tmp_path / "cibuildwheel.toml"
    broken.write_text(text.replace(" cp315-manylinux_*", "").replace("manylinux_* cp311", "* cp311"))
    ids = print_identifiers(broken, ROOT / "packages" / "astrai")
    assert ids != intended_identifiers()
    assert "cp310-musllinux_x86_64" in ids and "cp315-manylinux_x86_64" not in ids
