"""The plugin manifest's JSON Schema, published in docs/plugins.md, holds each plugin's
manifest (read from the source tree, as test_op_names does) and refuses what the core refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from build_helpers import FULL_BUILD_INFO, plugin_manifest_of
from fakes import manifest

ROOT = Path(__file__).resolve().parents[2]


def _schema() -> dict:
    text = (ROOT / "docs" / "plugins.md").read_text()
    block = re.search(r"as a JSON Schema.*?```json\n(.*?)\n```", text, re.S)
    assert block, "docs/plugins.md has no manifest JSON Schema"
    schema = json.loads(block[1])
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


@pytest.mark.parametrize("plugin", ["attention", "elementwise", "fp8"])
def test_each_plugin_manifest_fits_the_published_schema(plugin):
    package = ROOT / "packages" / f"astrai-{plugin}" / "src" / f"astrai_{plugin}"
    raw = plugin_manifest_of(package, f"_astrai_{plugin}_schema", build_info=FULL_BUILD_INFO)
    jsonschema.validate(json.loads(json.dumps(raw)), _schema())  # as JSON: tuples become lists


@pytest.mark.parametrize("broken", [{"api_version": 2}, {"cuda": "13"}, {"sass_archs": ["90a"]},
                                    {"ops": {"rotary_emb": {"module": "m", "dtypes": []}}}])
def test_the_schema_refuses_what_the_core_rejects(broken):
    from astrai.extension.manifest import ManifestError, parse_manifest

    raw = {**manifest(), **broken}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, _schema())
    with pytest.raises(ManifestError):
        parse_manifest(raw)
