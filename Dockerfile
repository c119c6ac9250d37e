# llmserve on CPU, serving the default model (SmolLM2-135M-Instruct) on port 8000.
#
#   docker build -t llmserve:cpu .
#   docker run --rm -p 8000:8000 llmserve:cpu
#
# The wheel is built in a first stage, which has a compiler: it carries the CPU kernels prebuilt for every CPU level
# (setup.py), so the image itself has none. torch is the version constraints.txt pins, as `make` installs it; the
# default model is fetched while the image is built (no download at start). The server runs as a non-root user.

FROM python:3.11-slim-bookworm AS wheel
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim-bookworm
# libgomp1: the OpenMP runtime the prebuilt kernels link (torch's own copy is private to torch)
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 llmserve
COPY --from=wheel /wheels /wheels
COPY constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir -c /tmp/constraints.txt /wheels/*.whl && rm -rf /wheels /tmp/constraints.txt
USER llmserve
ENV LLMSERVE_CACHE=/home/llmserve/.cache/llmserve
RUN llmserve --log-level warning fetch-model
COPY --chown=llmserve deploy/docker.yaml /app/docker.yaml
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
CMD ["llmserve", "serve", "--config", "/app/docker.yaml"]
