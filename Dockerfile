# The hub's image: `docker build -t model-hub .` (docker-compose.yml builds it as `hub`).
# Two stages: `build` installs the hub into a virtual environment, compiling its native CPU
# kernels (the only stage with a C compiler); the runtime image copies that environment.

# ---- build: dependencies, the package and its compiled kernels, in /opt/venv -------------
FROM python:3.11.15-slim-bookworm AS build

# torch comes from PyTorch's CPU index by default: the PyPI wheel bundles CUDA (gigabytes).
# For a GPU image pass the CUDA index instead (and uncomment the GPU block in the compose file):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# constraints.txt pins torch==2.13.0, which the index's 2.13.0+cpu / +cu128 builds satisfy.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    CC=gcc

# GCC builds the kernels (with GNU OpenMP, the runtime torch's wheels load).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

WORKDIR /src

# Dependencies first, from pyproject.toml and constraints.txt alone, so editing the source
# reuses this (large) layer.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['demo']))" > /tmp/requirements.txt \
    && PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}" \
    pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# Then the source, and the package itself (its dependencies are already satisfied). Installing
# it compiles the kernels (setup.py) for every x86-64 level, the baseline included, so the
# image runs on any x86-64 node: the hub loads the best level the node's CPU has. The check
# (run on the installed package, not this source tree: -P) fails the build if one is missing.
COPY setup.py README.md ./
COPY hub ./hub
COPY backends ./backends
COPY registry ./registry
COPY migrations ./migrations
RUN PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}" \
    pip install --no-cache-dir -c constraints.txt '.[demo]' \
    && python -P -m backends.llm.native_build check

# ---- runtime: the slim image and the environment built above (no compiler) ----------------
FROM python:3.11.15-slim-bookworm AS runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN groupadd --gid 1000 hub \
    && useradd --uid 1000 --gid hub --create-home --shell /usr/sbin/nologin hub \
    && mkdir -p /app /data/cache \
    && chown -R hub:hub /data

WORKDIR /app

# The installed hub, its compiled kernels among its files (backends/llm/_native).
COPY --from=build /opt/venv /opt/venv
COPY configs ./configs

USER hub
# Hugging Face downloads (hf:// sources) land on the /data volume with the hub's cache.
ENV HF_HOME=/data/hf
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready', timeout=4)"]

CMD ["hub", "serve", "--config", "/app/configs/compose.yaml", "--host", "0.0.0.0", "--port", "8000"]
