# Serve a draftsmith bundle with vLLM: the target plus the bundle's draft model or EAGLE-3 head.
#   docker build -f deploy/vllm.Dockerfile -t draftsmith-vllm .
#   docker run --gpus all -p 8000:8000 -v /path/to/bundle:/bundle:ro -v /path/to/target:/models/target:ro draftsmith-vllm
# The bundle's speculative_config.json says the method (draft_model or eagle3) and K; its serve.sh runs
# vllm serve with TARGET pointing at the mounted target. vLLM 0.33 serves both methods.
FROM vllm/vllm-openai:v0.33.0
COPY deploy/check_cuda.sh /usr/local/bin/check_cuda
ENV TARGET=/models/target
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
ENTRYPOINT ["check_cuda", "/bundle/serve.sh", "vllm", "--host", "0.0.0.0", "--port", "8000"]
