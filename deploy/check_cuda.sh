#!/usr/bin/env bash
# Start check for the serving images: stop with a clear message when the host's NVIDIA driver supports
# an older CUDA than the image was built for (the most common failure of GPU containers), else run the
# command given. Usage: check_cuda.sh COMMAND [ARGS...]. The image's CUDA comes from CUDA_VERSION (set
# by NVIDIA's CUDA base images, which vLLM's images build on); the driver's from nvidia-smi's header.
set -euo pipefail

version_number() {  # "12.9.1" -> 12009 (major * 1000 + minor)
  local major minor
  IFS=. read -r major minor _ <<<"$1"
  echo $(( 10#${major:-0} * 1000 + 10#${minor:-0} ))
}

image=${CUDA_VERSION:-}
if [[ -z "$image" ]]; then
  echo "check_cuda: this image does not say which CUDA it was built for (CUDA_VERSION is unset)" >&2
  exit 2
fi
if ! header=$(nvidia-smi 2>&1); then
  echo "check_cuda: nvidia-smi failed, so no GPU is visible in the container: run it with --gpus all" \
       "(docker) or a GPU device reservation (compose), on a host with the NVIDIA container toolkit" >&2
  exit 3
fi
driver=$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' <<<"$header" | head -n 1)
if [[ -z "$driver" ]]; then
  echo "check_cuda: could not read the driver's CUDA version from nvidia-smi" >&2
  exit 3
fi
if (( $(version_number "$driver") < $(version_number "$image") )); then
  echo "check_cuda: this image is built for CUDA $image but the host's NVIDIA driver supports CUDA $driver at" \
       "most: upgrade the host driver to one for CUDA $image or newer, or use an image built for CUDA $driver" >&2
  exit 1
fi
echo "check_cuda: image CUDA $image, host driver CUDA $driver: ok"
exec "$@"
