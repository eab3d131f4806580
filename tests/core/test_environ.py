"""env_reader: the cheap per-call read of an environment variable sees every change made
through os.environ at once, like os.environ.get."""

import os

from astrai.extension.environ import env_reader

NAME = "ASTRAI_TEST_ENV_READER"


def test_a_reader_follows_os_environ(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    read = env_reader(NAME)
    assert read() is None
    for value in ("1", "", "torch_native", "ä ß"):
        monkeypatch.setenv(NAME, value)
        assert read() == value == os.environ.get(NAME)
    os.environ.pop(NAME)
    assert read() is None
    os.environ.update({NAME: "cuda"})
    assert read() == "cuda"


def test_a_reader_of_an_other_variable_is_not_confused(monkeypatch):
    monkeypatch.setenv(NAME, "set")
    monkeypatch.delenv(NAME + "_OTHER", raising=False)
    assert env_reader(NAME + "_OTHER")() is None
    assert env_reader(NAME)() == "set"


def test_a_readers_raw_value_changes_exactly_when_the_variable_does(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    read = env_reader(NAME)
    unset = read.raw()
    assert unset is None
    monkeypatch.setenv(NAME, "cuda")
    first = read.raw()
    assert first is not None and first != unset
    assert read.raw() == first  # unchanged: equal
    monkeypatch.setenv(NAME, "flash")
    assert read.raw() not in (first, None)
    os.environ.pop(NAME)
    assert read.raw() is None
