# Sourced by the device-call scripts (run from the repository root on the GPU machine): the wheels carried in .whl/
# (pytest-xdist, hypothesis; see the device tool's README) installed to /tmp/site when the machine lacks them, the
# repository and /tmp/site on PYTHONPATH, unbuffered output, and the GPU's name.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
