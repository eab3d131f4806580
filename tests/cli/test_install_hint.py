"""The install commands doctor prints: right index / build per driver, every installer."""

import shlex

import pytest

from astrai.cli.install_hint import EXTRAS, INSTALLERS, conda_package, install_command

CU130 = "https://astrai-kernels.github.io/whl/cu130"
CU124 = "https://astrai-kernels.github.io/whl/cu124"


@pytest.mark.parametrize("driver, index", [((13, 0), CU130), ((13, 2), CU130), ((14, 1), CU130),
                                           ((12, 4), CU124), ((12, 9), CU124)])
def test_pip_picks_the_index_of_the_newest_build_the_driver_runs(driver, index):
    assert install_command(driver, "pip") == f'pip install "astrai[all]" --extra-index-url {index}'
    assert install_command(driver, "pip", "fp8") == f'pip install "astrai[fp8]" --extra-index-url {index}'


@pytest.mark.parametrize("driver, major", [((13, 0), 13), ((14, 0), 13), ((12, 4), 12), ((12, 8), 12)])
def test_conda_and_pixi_pin_the_cuda_major_of_that_build(driver, major):
    conda = install_command(driver, "conda", "rotary")
    assert conda.startswith("conda install -c https://astrai-kernels.github.io/conda -c conda-forge ")
    assert shlex.split(conda)[-2:] == ["astrai-elementwise", f"cuda-version={major}"]
    pixi = install_command(driver, "pixi")
    steps = [shlex.split(step) for step in pixi.split(" && ")]
    assert steps[0] == ["pixi", "workspace", "channel", "add", "https://astrai-kernels.github.io/conda"]
    assert steps[1] == ["pixi", "workspace", "system-requirements", "add", "cuda", "%d.%d" % driver]
    assert steps[2] == ["pixi", "add", "astrai-kernels", f"cuda-version={major}.*"]


@pytest.mark.parametrize("driver", [None, (12, 2), (11, 8)])
def test_without_a_usable_driver_every_installer_gets_the_core_only(driver):
    assert install_command(driver, "pip") == "pip install astrai"
    assert shlex.split(install_command(driver, "conda"))[-1] == "astrai"
    assert install_command(driver, "pixi").endswith("&& pixi add astrai")


def test_channel_and_index_follow_the_environment(monkeypatch):
    monkeypatch.setenv("ASTRAI_CONDA_CHANNEL", "http://127.0.0.1:8000/conda/")
    monkeypatch.setenv("ASTRAI_INDEX_URL", "http://127.0.0.1:8000/whl")
    assert "-c http://127.0.0.1:8000/conda -c conda-forge" in install_command((13, 0), "conda")
    assert install_command((12, 4), "pip").endswith("--extra-index-url http://127.0.0.1:8000/whl/cu124")


def test_every_extra_names_a_package_for_every_installer():
    for extra in EXTRAS:
        for installer in INSTALLERS:
            assert install_command((13, 0), installer, extra)
    assert [conda_package(e) for e in EXTRAS] == ["astrai-kernels", "astrai-attention", "astrai-elementwise", "astrai-fp8"]


@pytest.mark.parametrize("args, word", [(((13, 0), "uv"), "installer"), (((13, 0), "pip", "flash"), "extra"),
                                        (((13,), "pip"), "driver_cuda"), ((("13", "0"), "conda"), "driver_cuda")])
def test_bad_arguments_name_the_argument(args, word):
    with pytest.raises(ValueError, match=word):
        install_command(*args)


def test_the_module_examples_hold():
    import doctest

    import astrai.cli.install_hint as module

    assert doctest.testmod(module).failed == 0


def test_the_install_guide_shows_the_commands_doctor_prints():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text()
    for driver in ((13, 0), (12, 4)):
        assert install_command(driver, "pip") in guide
        assert install_command(driver, "pip", "fp8").split(" --extra")[0] in guide
    assert install_command((13, 0), "conda") in guide
    assert install_command(None, "conda") in guide
    for step in install_command((13, 0), "pixi").split(" && "):
        assert step in guide


def test_several_extras_join_in_one_command():
    assert install_command((13, 0), "pip", "rotary,fp8") == f'pip install "astrai[rotary,fp8]" --extra-index-url {CU130}'
    assert shlex.split(install_command((12, 6), "conda", "attention,fp8"))[-3:] == [
        "astrai-attention", "astrai-fp8", "cuda-version=12"]
    with pytest.raises(ValueError, match="extra"):
        install_command((13, 0), "pip", "rotary,flash")


@pytest.mark.parametrize("installed, extra", [
    (("astrai-attention", "astrai-elementwise", "astrai-fp8"), "all"),
    (("astrai-fp8", "astrai-elementwise"), "rotary,fp8"),
    (("astrai-attention",), "attention"),
])
def test_doctor_suggests_what_is_installed(monkeypatch, installed, extra):
    from fakes import FakeEntryPoint, entry_points, manifest

    from astrai.cli import doctor
    from astrai.extension.device import DeviceInfo
    from astrai.extension.registry import Registry

    monkeypatch.delenv("ASTRAI_INDEX_URL", raising=False)
    eps = [FakeEntryPoint(name.removeprefix("astrai-"), manifest(name=name)) for name in installed]
    registry = Registry(entry_points(*eps))
    for device in (DeviceInfo(type="cpu", index=None, name="cpu", capability=None, driver_cuda=None),
                   DeviceInfo(type="cuda", index=0, name="H200", capability=(9, 0), driver_cuda=(13, 1))):
        install = doctor._install_commands(device, registry)
        assert install["pip"] == f'pip install "astrai[{extra}]" --extra-index-url {CU130}'  # the +cu130 builds
        assert "docs/install.md" in install["unpublished"]
    monkeypatch.setenv("ASTRAI_INDEX_URL", "http://127.0.0.1:8000/whl")
    assert "unpublished" not in doctor._install_commands(device, registry)


def test_doctor_without_plugins_suggests_the_core_or_everything():
    from astrai.cli import doctor
    from astrai.extension.device import DeviceInfo
    from astrai.extension.registry import Registry

    empty = Registry(lambda: [])
    cpu = DeviceInfo(type="cpu", index=None, name="cpu", capability=None, driver_cuda=None)
    h200 = DeviceInfo(type="cuda", index=0, name="H200", capability=(9, 0), driver_cuda=(12, 8))
    assert doctor._install_commands(cpu, empty)["pip"] == "pip install astrai"
    assert doctor._install_commands(h200, empty)["pip"] == f'pip install "astrai[all]" --extra-index-url {CU124}'


def test_a_missing_plugin_error_says_the_index_is_unpublished(monkeypatch):
    from astrai.extension.ops import _plugin
    from astrai.extension.registry import Registry
    from astrai.extension.runtime import Runtime, use_runtime

    monkeypatch.delenv("ASTRAI_INDEX_URL", raising=False)
    with use_runtime(Runtime(Registry(lambda: []))):
        with pytest.raises(RuntimeError, match=r'astrai\[rotary\]" .*\(no release is published on that index yet'):
            _plugin.require("rotary_emb", "cpu")
        monkeypatch.setenv("ASTRAI_INDEX_URL", "http://127.0.0.1:8000/whl")
        with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:8000/whl/cu130$"):
            _plugin.require("rotary_emb", "cpu")


@pytest.mark.parametrize("version, cuda", [("0.1.0+cu130", (13, 0)), ("0.1.0+cu124.post1", (12, 4)),
                                           ("0.1.0+cu130.1", (13, 0)), ("0.1.0", None), ("0.1.0+cpu", None),
                                           ("not a version", None), (None, None)])
def test_doctor_reads_the_cuda_build_from_a_plugin_version(version, cuda):
    from astrai.cli import doctor

    assert doctor._cuda_of_version(version) == cuda


def test_a_rebuilt_cuda12_plugin_keeps_its_index(monkeypatch):
    # a disabled plugin has no manifest: doctor reads the CUDA build from its distribution's version
    from fakes import FakeEntryPoint, entry_points, manifest

    from astrai.cli import doctor
    from astrai.extension.device import DeviceInfo
    from astrai.extension.registry import Registry

    monkeypatch.delenv("ASTRAI_INDEX_URL", raising=False)
    ep = FakeEntryPoint("elementwise", manifest())
    ep.dist.version = "0.1.0+cu124.post1"
    registry = Registry(entry_points(ep), enabled=False)
    cpu = DeviceInfo(type="cpu", index=None, name="cpu", capability=None, driver_cuda=None)
    assert doctor._install_commands(cpu, registry)["pip"] == f'pip install "astrai[rotary]" --extra-index-url {CU124}'
