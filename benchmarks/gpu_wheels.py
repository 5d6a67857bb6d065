"""Carry the packages a GPU machine without network lacks, as wheels, in the checkout.

A lent GPU machine has its own Python, torch and transformers but no network, and not every
package the hub needs. On a machine with network, download the wheels (versions pinned by
constraints.txt, for the GPU machine's Python) into a folder of the checkout that git does
not ignore, so it travels with the working tree (about 64 MiB in all); on the GPU machine,
unpack them into a site folder put first on PYTHONPATH:

    python benchmarks/gpu_wheels.py download --python 3.12 --dest gpu_wheels
    # on the GPU machine, from the repository root:
    python benchmarks/gpu_wheels.py install --wheels gpu_wheels --site /tmp/gpu_site
    PYTHONPATH=/tmp/gpu_site python benchmarks/gpu_check.py --out "$OUT"

`install` uses `pip install --target` and, where pip cannot run, unpacks the wheels itself.
Do not commit the wheel folder.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the first GPU machine lacked (its image had torch, numpy, safetensors, tokenizers):
# the hub's own dependencies, the test runner, and a transformers newer than its own.
PACKAGES = (  # noqa: SIM905 - one string is easier to keep than 50 quoted names
    "alembic annotated-doc annotated-types anyio cachetools cffi click cloudpickle "
    "cryptography databricks-sdk fastapi h11 httpcore httpx httpx2 httpcore2 huggingface-hub idna "
    "importlib-metadata iniconfig llguidance mako mlflow-skinny mlflow-tracing nvidia-ml-py "
    "opentelemetry-api opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions "
    "pluggy prometheus-client protobuf pycparser pydantic pydantic-core pydantic-settings pytest "
    "pytest-asyncio pytest-timeout python-dotenv sentence-transformers sqlalchemy sqlparse "
    "starlette transformers truststore typer typing-extensions typing-inspection uvicorn zipp"
).split()


def pinned(names: list[str]) -> list[str]:
    """`name==version` for each name constraints.txt pins (a name it does not pin as is)."""
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    out = []
    for name in names:
        key = name.lower().replace("_", "-")
        out.append(f"{name}=={pins[key]}" if key in pins else name)
    return out


# pip matches a manylinux tag exactly: name every glibc level a wheel may be built for.
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip


def download(python: str, dest: Path, platforms: list[str]) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    tags = [arg for platform in platforms for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", *tags,
               "--dest", str(dest), *pinned(PACKAGES)]  # fmt: skip
    return subprocess.call(command)


def unpack(wheels: Path, site: Path) -> None:
    """Unzip every wheel into `site`, moving `*.data/purelib|platlib` to the top."""
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                parts = Path(info.filename).parts
                if parts and parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts and headers are not needed
                    target = site.joinpath(*parts[2:])
                else:
                    target = site / info.filename
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst)


def install(wheels: Path, site: Path) -> int:
    site.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--upgrade", "--target", str(site),
               *map(str, sorted(wheels.glob("*.whl")))]  # fmt: skip
    if subprocess.call(command) != 0:
        print("pip failed; unpacking the wheels instead", flush=True)
        unpack(wheels, site)
    print(f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="fetch the wheels (needs network)")
    d.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12)")
    d.add_argument("--platform", action="append", help=f"a wheel tag (default: {PLATFORMS})")
    d.add_argument("--dest", type=Path, default=ROOT / "gpu_wheels")
    i = sub.add_parser("install", help="unpack them into a site folder (no network)")
    i.add_argument("--wheels", type=Path, default=ROOT / "gpu_wheels")
    i.add_argument("--site", type=Path, default=Path("/tmp/gpu_site"))
    args = p.parse_args(argv)
    if args.command == "download":
        return download(args.python, args.dest, args.platform or list(PLATFORMS))
    return install(args.wheels, args.site)


if __name__ == "__main__":
    raise SystemExit(main())
