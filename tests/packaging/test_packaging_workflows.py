"""The GitHub Actions workflows: parsed, and checked for the jobs a release needs.

``release_problems`` / ``ci_problems`` return what is missing, so the mutation tests can
show each check failing on a broken workflow.
"""

from __future__ import annotations

import copy
import itertools
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
PLUGINS = {"attention", "elementwise", "fp8"}
CUDA = {"12.4", "13.0"}


def load(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    # YAML 1.1 reads the key `on` as True
    if True in data:
        data["on"] = data.pop(True)
    return data


def _steps(job: dict) -> list[dict]:
    return job.get("steps", [])


def _uses(job: dict, action: str) -> list[dict]:
    return [s for s in _steps(job) if str(s.get("uses", "")).split("@")[0] == action]


def _runs(job: dict) -> str:
    return "\n".join(str(s.get("run", "")) for s in _steps(job))


def _needs(job: dict) -> set[str]:
    needs = job.get("needs", [])
    return {needs} if isinstance(needs, str) else set(needs)


def release_problems(wf: dict) -> list[str]:
    problems = []
    jobs = wf.get("jobs", {})
    on = wf.get("on", {})
    if "push" not in on or not any(str(t).startswith("v") for t in on["push"].get("tags", [])):
        problems.append("release must run on pushed version tags")

    wheels = jobs.get("wheels", {})
    matrix = wheels.get("strategy", {}).get("matrix", {})
    if set(matrix.get("plugin", [])) != PLUGINS:
        problems.append(f"wheels matrix plugins {matrix.get('plugin')} != {sorted(PLUGINS)}")
    if set(matrix.get("cuda", [])) != CUDA:
        problems.append(f"wheels matrix CUDA {matrix.get('cuda')} != {sorted(CUDA)}")
    if set(matrix.get("arch", [])) != {"x86_64", "aarch64"}:
        problems.append("wheels matrix must cover x86_64 and aarch64")
    cibw = _uses(wheels, "pypa/cibuildwheel")
    if not cibw:
        problems.append("wheels job does not run cibuildwheel")
    else:
        step = cibw[0]
        if step.get("with", {}).get("config-file") != "ci/cibuildwheel.toml":
            problems.append("cibuildwheel must use ci/cibuildwheel.toml")
        if "matrix.plugin" not in str(step.get("with", {}).get("package-dir", "")):
            problems.append("cibuildwheel must build packages/astrai-<plugin>")
        if "matrix.cuda" not in str(step.get("env", {}).get("ASTRAI_CUDA", "")):
            problems.append("cibuildwheel must get ASTRAI_CUDA from the matrix")
    if "ci/check-wheel-size" not in _runs(wheels):
        problems.append("wheels job must enforce the size budget (ci/check-wheel-size)")
    if "ASTRAI_CUDA_ARCHS" not in wf.get("env", {}) and "ASTRAI_CUDA_ARCHS" not in str(wheels):
        problems.append("ASTRAI_CUDA_ARCHS must be settable for the wheels (per-arch builds)")

    core = jobs.get("core-and-sdists", {})
    runs = _runs(core)
    if "packages/astrai" not in runs or "--sdist" not in runs:
        problems.append("core-and-sdists must build the core wheel and every sdist")

    conda = jobs.get("conda", {})
    rb = _uses(conda, "prefix-dev/rattler-build-action")
    if not rb or rb[0].get("with", {}).get("recipe-path") != "recipe/recipe.yaml":
        problems.append("conda job must run rattler-build on recipe/recipe.yaml")

    site = jobs.get("site", {})
    if not {"wheels", "core-and-sdists", "conda"} <= _needs(site):
        problems.append("site must wait for wheels, core-and-sdists and conda")
    if "ci/make-index" not in _runs(site):
        problems.append("site must write the per-CUDA indexes with ci/make-index")
    if "ci/index-conda" not in _runs(site):
        problems.append("site must index the conda channel")
    for cuda in CUDA:
        if cuda not in _runs(site):
            problems.append(f"site does not lay out the CUDA {cuda} index")
    if not _uses(site, "actions/upload-pages-artifact"):
        problems.append("site must upload the static site")
    publish = jobs.get("publish-site", {})
    if "site" not in _needs(publish) or not _uses(publish, "actions/deploy-pages"):
        problems.append("publish-site must deploy the site after it is built")
    if "pages" not in publish.get("permissions", {}):
        problems.append("publish-site needs the pages permission")
    pypi = jobs.get("publish-pypi", {})
    if not _uses(pypi, "pypa/gh-action-pypi-publish"):
        problems.append("publish-pypi must upload the core and sdists")
    return problems


def ci_problems(wf: dict) -> list[str]:
    problems = []
    if "pull_request" not in wf.get("on", {}):
        problems.append("ci must run on pull requests")
    jobs = wf.get("jobs", {})
    tests = [j for j in jobs.values() if "bash .ci/run" in _runs(j)]
    if not tests:
        problems.append("no job runs the CPU test suite (bash .ci/run)")
    elif any(int(j.get("timeout-minutes", 10**6)) > 90 for j in tests):
        problems.append("the CPU test job must stop within CI's 90 minutes")
    return problems


def test_every_workflow_parses_and_names_its_jobs():
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} >= {"ci.yml", "release.yml"}
    for f in files:
        wf = load(f.name)
        assert wf.get("name") and wf.get("on") and wf.get("jobs"), f.name
        for job_id, job in wf["jobs"].items():
            assert "runs-on" in job and ("steps" in job), f"{f.name}: job {job_id}"
            for needed in _needs(job):
                assert needed in wf["jobs"], f"{f.name}: {job_id} needs unknown job {needed}"


def test_release_builds_every_channel():
    assert release_problems(load("release.yml")) == []


def test_pull_requests_run_the_cpu_tests():
    assert ci_problems(load("ci.yml")) == []


def test_scripts_the_workflows_call_exist_and_are_executable():
    text = "\n".join(f.read_text() for f in WORKFLOWS.glob("*.yml"))
    for script in ("ci/make-index", "ci/index-conda", "ci/provision-cuda13", "ci/cibuildwheel.toml", "ci/check-wheel-size",
                   "recipe/recipe.yaml", "ci/requirements-packaging.txt"):
        assert script in text and (ROOT / script).is_file(), script
    for script in ("ci/make-index", "ci/index-conda", "ci/provision-cuda13", "ci/check-wheel-size"):
        assert os.access(ROOT / script, os.X_OK), script


def test_wheel_matrix_is_the_recipes_matrix():
    import sys

    sys.path.insert(0, str(ROOT / "ci"))
    from conda_channel import render_recipe

    outputs = render_recipe("linux-64")
    matrix = load("release.yml")["jobs"]["wheels"]["strategy"]["matrix"]
    assert set(matrix["cuda"]) == {o.cuda for o in outputs if o.cuda}
    assert {f"astrai-{p}" for p in matrix["plugin"]} == {o.name for o in outputs if o.cuda}
    conda = load("release.yml")["jobs"]["conda"]["strategy"]["matrix"]
    assert set(conda["python"]) == {o.python for o in outputs if o.python}


def _without(wf: dict, path: list) -> dict:
    wf = copy.deepcopy(wf)
    node = wf
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return wf


@pytest.mark.parametrize("path, says", [
    (["jobs", "conda"], "rattler-build"),
    (["jobs", "site", "needs"], "site must wait"),
    (["jobs", "wheels", "steps", 1], "cibuildwheel"),
    (["jobs", "publish-site"], "deploy"),
    (["on", "push"], "tags"),
])
def test_a_broken_release_workflow_is_caught(path, says):
    problems = release_problems(_without(load("release.yml"), path))
    assert any(says in p for p in problems), problems


def test_a_release_matrix_missing_a_cuda_version_is_caught():
    wf = load("release.yml")
    wf["jobs"]["wheels"]["strategy"]["matrix"]["cuda"] = ["13.0"]
    assert any("CUDA" in p for p in release_problems(wf))


def test_a_ci_workflow_without_tests_is_caught():
    wf = load("ci.yml")
    for job in wf["jobs"].values():
        job["steps"] = [s for s in job["steps"] if ".ci/run" not in str(s.get("run", ""))]
    assert ci_problems(wf) == ["no job runs the CPU test suite (bash .ci/run)"]
    assert ci_problems(_without(load("ci.yml"), ["on", "pull_request"]))


def test_workflow_matrices_expand_to_the_intended_jobs():
    matrix = load("release.yml")["jobs"]["wheels"]["strategy"]["matrix"]
    jobs = list(itertools.product(matrix["plugin"], matrix["cuda"], matrix["arch"]))
    assert len(jobs) == 12
    runners = {inc["arch"]: inc["runner"] for inc in matrix["include"]}
    assert runners == {"x86_64": "ubuntu-24.04", "aarch64": "ubuntu-24.04-arm"}
