"""Wheel names, versions and requirements as the ci/ scripts read them: through
``packaging``, so the forms a hand-written split or pattern missed (``~=``, ``!=``, extras,
markers, a ``+cu130.post1`` rebuild, a compressed platform set) read right."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest
from build_helpers import _build_wheels

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
from conda_channel import ChannelError, read_wheel_name  # noqa: E402


def _script(name: str):
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(ROOT / "ci" / name))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "cuda", "python", "platform"), [
    ("astrai_elementwise-0.1.0+cu130-cp312-cp312-manylinux_2_28_x86_64.whl", "13.0", "3.12", "manylinux_2_28_x86_64"),
    ("astrai_elementwise-0.1.0+cu130.post1-cp311-cp311-manylinux_2_28_x86_64.whl", "13.0", "3.11", "manylinux_2_28_x86_64"),
    ("Astrai.FP8-0.1.0+cu124-1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "12.4", "3.12",
     "manylinux2014_x86_64.manylinux_2_17_x86_64"),
    ("astrai-0.1.0-py3-none-any.whl", None, None, "any"),
])
def test_conda_channel_reads_wheel_names(name, cuda, python, platform):
    wheel = read_wheel_name(Path(name))
    assert (wheel.cuda, wheel.python, wheel.platform_tag, wheel.base_version) == (cuda, python, platform, "0.1.0")
    assert wheel.name in ("astrai", "astrai-elementwise", "astrai-fp8")


@pytest.mark.parametrize(("name", "why"), [("astrai_elementwise-0.1.0+cpu-cp312-cp312-linux_x86_64.whl", "not a CUDA tag"),
                                           ("astrai_elementwise-0.1.0.whl", "not a wheel file name")])
def test_conda_channel_refuses_what_is_no_plugin_wheel(name, why):
    with pytest.raises(ChannelError, match=why):
        read_wheel_name(Path(name))


@pytest.mark.parametrize(("name", "tag"), [
    ("astrai_elementwise-0.1.0+cu130-cp312-cp312-manylinux_2_28_x86_64.whl", "manylinux_2_28_x86_64"),
    ("astrai_elementwise-0.1.0+cu130-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "manylinux_2_17_x86_64"),
    ("manylinux_tools-0.1.0-py3-none-any.whl", None),  # the name is no platform
])
def test_build_wheels_reads_the_manylinux_tag(name, tag):
    assert _build_wheels().manylinux_tag(name) == tag


def test_check_pip_install_reads_every_requirement_form(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.optional-dependencies]\n'
                         'fp8 = ["astrai-fp8~=0.1.0"]\n'
                         'rotary = ["astrai-elementwise!=0.1.1,>=0.1"]\n'
                         'attention = ["astrai-attention[extra]==0.1.0"]\n'
                         'all = ["Astrai_Elementwise<0.2; python_version >= \'3.10\'", "astrai-fp8>0.0"]\n'
                         'plot = ["matplotlib>=3.7"]\n')
    assert _script("check-pip-install").extra_plugins(pyproject) == {
        "fp8": ["astrai-fp8"], "rotary": ["astrai-elementwise"], "attention": ["astrai-attention"],
        "all": ["astrai-elementwise", "astrai-fp8"]}


def test_check_pip_install_reads_the_core_extras():
    extras = _script("check-pip-install").extra_plugins()
    assert extras["all"] == ["astrai-attention", "astrai-elementwise", "astrai-fp8"] and "plot" not in extras


@pytest.mark.parametrize("depth", [1, 12])  # 12 folders of 20 characters: far past a 127-byte #! line
def test_console_scripts_start_with_env_python_however_long_the_staging_path(tmp_path, depth):
    import zipfile

    from conda_channel import Output, _stage_wheel

    wheel_path = tmp_path / "astrai-0.1.0-py3-none-any.whl"
    info = "astrai-0.1.0.dist-info"
    with zipfile.ZipFile(wheel_path, "w") as wheel:
        wheel.writestr("astrai/__init__.py", "def main():\n    return 0\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: astrai\nVersion: 0.1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/entry_points.txt", "[console_scripts]\nastrai = astrai:main\n")
        wheel.writestr(f"{info}/RECORD", "")
    output = Output("astrai", "0.1.0", "pyh0_0", "python", (), {}, "", "", "")
    staging = tmp_path.joinpath(*["s" * 20] * depth)
    _stage_wheel(read_wheel_name(wheel_path), output, staging)
    script = (staging / "python-scripts" / "astrai").read_text()
    assert script.startswith("#!/usr/bin/env python\n") and "exec" not in script.split("\n", 1)[0], script[:200]
    assert "from astrai import main" in script
