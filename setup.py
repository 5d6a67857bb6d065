"""The package's build step for its native CPU kernels; everything else is in pyproject.toml.

`build_kernels` runs as part of `build`, so every install compiles the kernels of
`backends/llm/csrc` into the package (`backends/llm/_native/`, one library per kernel and
variant: see `backends/llm/native_build.py`): into the wheel for `pip install .`, and into
the source tree for `pip install -e .`, where the editable package reads them from. `CC`
picks the compiler (`cc` by default). Without a compiler the install still succeeds and
says so: the engine then compiles at first use where it can, or runs its slower torch path
(and says so).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("backends", "llm", "_native")


def _native_build() -> ModuleType:
    """`backends/llm/native_build.py`, loaded by path: nothing is installed yet."""
    name = "_model_hub_native_build"
    spec = importlib.util.spec_from_file_location(name, ROOT / "backends/llm/native_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class build_kernels(Command):
    """Compile the native CPU kernels into the package."""

    description = "compile the native CPU kernels (backends/llm/csrc) into the package"
    user_options: ClassVar = [("build-lib=", "b", "directory the package is built in")]

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False  # set by setuptools for `pip install -e`
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        native = _native_build()
        # Editable: beside the sources the package is imported from.
        root = ROOT if self.editable_mode else Path(self.build_lib or "build/lib")
        compiler = os.environ.get("CC") or "cc"
        result = native.build_all(root / PACKAGE_DIR, compiler)
        for error in result.failed:
            print(f"WARNING: native kernel build: {error}", file=sys.stderr)
        if not result.built:
            print(
                "WARNING: no native CPU kernel was built (no working C compiler "
                f"{compiler!r}?): the LLM engine will compile them at first use where a "
                "compiler is found, else run its slower torch path",
                file=sys.stderr,
            )
        self._outputs = [] if self.editable_mode else [str(p) for p in result.built]

    def get_outputs(self) -> list[str]:
        return self._outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "backends/llm/csrc").iterdir())]


class build_with_kernels(build):
    sub_commands: ClassVar = [*build.sub_commands, ("build_kernels", None)]


class BinaryDistribution(Distribution):
    """A wheel holding compiled libraries is specific to a platform."""

    def has_ext_modules(self) -> bool:
        return True


setup(
    cmdclass={"build": build_with_kernels, "build_kernels": build_kernels},
    distclass=BinaryDistribution,
)
