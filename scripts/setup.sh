# Sourced by scripts/main-job and scripts/test: everything a fresh machine needs.
#  - a virtual environment (.venv) unless one is already active; it sees the system's
#    site-packages, so a GPU host's preinstalled CUDA torch / Triton / CuPy are used as they are;
#  - torch: when none is importable and no GPU is present, the CPU build (torch==2.13.0+cpu),
#    never the multi-GB CUDA build a loose requirement would pull;
#  - this package with its test extras, editable (skipped when already installed as it is);
#  - without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    if [ ! -x .venv/bin/python ]; then
        echo "setup: creating .venv" >&2
        "$PY" -m venv --system-site-packages .venv
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# one torch import (~2 s) says both whether torch is there and whether it sees a GPU:
# "cuda", "cpu", or nothing when it cannot be imported
torch_probe() { python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null | tail -n 1 || true; }
torch_on="$(torch_probe)"
if [ -z "$torch_on" ]; then
    if has_gpu; then
        echo "setup: no torch found on a GPU machine: installing torch (CUDA build)" >&2
        python -m pip install --quiet torch
    else
        # PyPI's Linux torch is the CUDA build; the CPU build is torch==X+cpu on PyTorch's CPU
        # index. Where pip's configured sources already hold it (a local wheel folder), no
        # network is asked; macOS wheels are CPU-only and carry no "+cpu" tag.
        cpu_torch="torch==2.13.0+cpu"
        [ "$(uname -s)" = Darwin ] && cpu_torch="torch==2.13.0"
        cpu_index=()
        if ! python -m pip install --quiet --dry-run --no-deps "$cpu_torch" >/dev/null 2>&1; then
            cpu_index=(--extra-index-url "${MICROBENCH_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
        fi
        echo "setup: no GPU: installing the CPU build of torch ($cpu_torch${cpu_index[*]:+ from ${cpu_index[1]}})" >&2
        python -m pip install --quiet "$cpu_torch" "${cpu_index[@]}"
    fi
    torch_on="$(torch_probe)"
fi
# pip only when something changed: scripts/installed.py says what (a first install, a changed
# pyproject.toml, a package removed or swapped since); MICROBENCH_REINSTALL=1 forces it
if [ -n "${MICROBENCH_REINSTALL:-}" ] || ! why="$(python scripts/installed.py 2>&1)"; then
    [ -n "${MICROBENCH_REINSTALL:-}" ] && why="MICROBENCH_REINSTALL is set"
    echo "setup: installing microbench with its test extras ($why)" >&2
    python -m pip install --quiet -e ".[test]"
    python scripts/installed.py --record
fi
if [ "$torch_on" != cuda ]; then
    export TRITON_INTERPRET=1
fi

# parallel_args: sets the array `parallel` to pytest-xdist's arguments for the parallel
# pass: a worker per core, at most 4; MICROBENCH_TEST_WORKERS=N picks N (0 or 1: none)
parallel_args() {
    local workers="${MICROBENCH_TEST_WORKERS:-}"
    if [ -z "$workers" ]; then
        workers=$(python -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
    fi
    if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
        echo "test: MICROBENCH_TEST_WORKERS must be a whole number, got '$workers'" >&2
        exit 2
    fi
    parallel=()
    if [ "$workers" -gt 1 ]; then
        parallel=(-n "$workers" --dist worksteal)
    fi
}
