"""Run a ci/ script under a Python that has its tools: this one, else the project venv.

Started with any interpreter (``python3 ci/build-wheels``, the shebang's ``python3``), a
script that needs packages this interpreter lacks re-executes itself under ``.venv/bin/python``,
making ``.venv`` first with ``ci/dev-env`` (from this interpreter) when the clone has none.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
_REEXEC = "ASTRAI_CI_REEXEC"


def missing(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def python_tag(python: str = sys.executable) -> str:
    """``cp311``: the tag of the wheels ``python`` builds and installs."""
    if python == sys.executable:
        return "cp%d%d" % sys.version_info[:2]
    out = subprocess.run([python, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def ensure(script: str, modules: tuple[str, ...]) -> None:
    """Return when this interpreter has ``modules``; else re-execute the running script
    under the project venv (made by ci/dev-env if absent), or exit saying what to do."""
    lacking = missing(modules)
    if not lacking:
        return
    here = f"{sys.executable} (Python {sys.version.split()[0]})"
    if os.environ.get(_REEXEC) or Path(sys.prefix).resolve() == VENV_PYTHON.parent.parent.resolve():
        raise SystemExit(f"{script}: {here} lacks {', '.join(lacking)}: run ci/dev-env (it installs "
                         "ci/requirements-dev.txt and ci/requirements-*.txt into .venv)")
    if not VENV_PYTHON.exists():
        print(f"{script}: {here} lacks {', '.join(lacking)}; making the project venv with ci/dev-env",
              file=sys.stderr, flush=True)
        made = subprocess.run([str(ROOT / "ci" / "dev-env")], env=dict(os.environ, PYTHON=sys.executable))
        if made.returncode != 0:
            raise SystemExit(f"{script}: ci/dev-env failed (exit {made.returncode}); it is what makes "
                             ".venv with the build tools")
    print(f"{script}: {here} lacks {', '.join(lacking)}; running under {VENV_PYTHON}",
          file=sys.stderr, flush=True)
    os.environ[_REEXEC] = "1"
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), os.path.abspath(sys.argv[0]), *sys.argv[1:]])
