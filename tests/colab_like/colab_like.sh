#!/usr/bin/env bash
# Colab's default GPU runtime, as closely as a CPU machine allows, and the notebook's own TE
# install and import cells run in it, each phase in a fresh venv with an empty pip cache:
#   before      the cells as they were before the install was fixed (commit 4c65f9c);
#   after       the cells as they are now, TE_WHEEL_DIR unset;
#   kept-build  TE_WHEEL_DIR set to an empty folder: the extension compiles, with a progress bar,
#               and its wheel is kept there;
#   kept-reuse  a new venv (a new Colab session), the same folder: TE installs from the kept wheel.
# Run by hand, as root:
#
#     [PHASES="kept-build kept-reuse"] tests/colab_like/colab_like.sh [DIR]   # DIR: /tmp/colab_like
#
# Each compiling phase takes 9 to 14 minutes on 2 cores, a fresh venv 3, the set-up 1. Everything
# goes to DIR: each phase's output (PHASE.log, pip's own log as PHASE-pip.log) and a summary with
# timings (report.txt).
#
# Reproduced (Colab's image as its published package lists describe it, August 2026; that image
# has the layout of NVIDIA's CUDA 12.8 "cudnn-devel" images, cuDNN 9.8.0.87 included):
#   - Python 3.13; a CUDA 12.8 build of torch from PyPI with pip's cuDNN 9.19;
#   - /usr/local/cuda -> a CUDA 12.8 toolkit (headers and libraries from NVIDIA's wheels);
#   - a system cuDNN 9.8 (headers in /usr/include, libraries in /usr/lib/x86_64-linux-gnu, where
#     apt's libcudnn9-dev-cuda-12 puts them) and NCCL 2.25 (libnccl-dev) beside it;
#   - no ninja; setuptools and wheel installed; pip with no configuration and an empty cache.
# Different from Colab: torch 2.10.0 (PyPI's newest CUDA 12 build), not 2.11.0+cu128 from
# PyTorch's index, with its cuDNN pin rewritten from 9.10 to the 9.19 installed, as Colab's torch
# pins it (or pip would "repair" it back to 9.10); nvcc: NVIDIA ships no CUDA 12 nvcc binary on
# PyPI (the cu12 wheel holds ptxas only) and nothing else is reachable here, so
# /usr/local/cuda/bin/nvcc is a script that answers `nvcc -V` as nvcc 12.8.93 does; TE's PyTorch
# build runs nvcc for nothing else (build_tools/utils.py: the CUDA version and the toolkit's
# root; it compiles with g++); g++ 12 (Debian), not 11 (Ubuntu); a venv, not the system Python;
# no GPU, so the notebook is told "an L4, compute capability 8.9, exists" and nothing runs a
# kernel; this machine's cores and memory, not Colab's.
# The system changes live in a private mount namespace (overlays on /usr/bin, /usr/include,
# /usr/lib/x86_64-linux-gnu and /usr/local, a private /etc/ld.so.cache); nothing else sees them.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DIR=$(mkdir -p "${1:-/tmp/colab_like}" && cd "${1:-/tmp/colab_like}" && pwd)
PYTHON=${PYTHON313:-/root/.pyenv/versions/3.13.0/bin/python3.13}
BEFORE_COMMIT=4c65f9c
cd "$DIR"
say() { echo "[$(date +%T)] $*" | tee -a report.txt; }
pip_isolated() { "$1" -m pip --isolated --disable-pip-version-check --quiet "${@:2}"; }

TOOLKIT=(nvidia-cuda-nvcc-cu12==12.8.93 nvidia-cuda-runtime-cu12==12.8.90
    nvidia-cuda-cccl-cu12==12.8.90 nvidia-cublas-cu12==12.8.4.1 nvidia-cusparse-cu12==12.5.8.93
    nvidia-cusolver-cu12==11.7.3.90 nvidia-curand-cu12==10.3.9.90 nvidia-cufft-cu12==11.3.3.83
    nvidia-cuda-nvrtc-cu12==12.8.93 nvidia-nvtx-cu12==12.8.90 nvidia-cuda-cupti-cu12==12.8.90
    nvidia-nvjitlink-cu12==12.8.93)
SYSTEM=(nvidia-cudnn-cu12==9.8.0.87 nvidia-nccl-cu12==2.25.1)
TORCH=torch==2.10.0 COLAB_CUDNN=9.19.0.56

assemble_system() {  # sys/<mount point>: what Colab's image has there and this machine has not
    rm -rf sys stage && mkdir -p sys/usr/{bin,include,lib/x86_64-linux-gnu,local} stage
    pip_isolated python3 download --no-deps -d wheels "${TOOLKIT[@]}" "${SYSTEM[@]}"
    for wheel in wheels/*.whl; do python3 -m zipfile -e "$wheel" stage/; done
    local cuda=sys/usr/local/cuda-12.8 lib=sys/usr/lib/x86_64-linux-gnu
    mkdir -p "$cuda/bin" "$cuda/include" "$cuda/lib64"
    for package in stage/nvidia/*/; do
        case $(basename "$package") in cudnn | nccl) continue ;; esac
        for part in bin include nvvm; do
            [[ -d $package/$part ]] && cp -a "$package/$part/." "$cuda/${part}/"
        done
        [[ -d $package/lib ]] && cp -a "$package/lib/." "$cuda/lib64/"
    done
    cp -a stage/nvidia/cudnn/include/. stage/nvidia/nccl/include/. sys/usr/include/
    cp -a stage/nvidia/cudnn/lib/. stage/nvidia/nccl/lib/. "$lib/"
    for so in "$lib"/*.so.[0-9]; do ln -sf "$(basename "$so")" "${so%.[0-9]}"; done  # -dev links
    find sys -name __init__.py -delete && chmod +x "$cuda"/bin/*
    printf '%s\n' '#!/bin/sh' 'case "$1" in -V | --version) ;; *) echo "nvcc stand-in: -V only" >&2; exit 1 ;; esac' \
        'echo "nvcc: NVIDIA (R) Cuda compiler driver"' \
        'echo "Cuda compilation tools, release 12.8, V12.8.93"' > "$cuda/bin/nvcc"
    chmod +x "$cuda/bin/nvcc"
}

make_venv() {  # Colab's Python packages, as far as the install and import cells touch them
    rm -rf "$1" && "$PYTHON" -m venv "$1"
    pip_isolated "$1/bin/python" install "$TORCH" setuptools wheel tqdm numpy matplotlib
    pip_isolated "$1/bin/python" install --no-deps "nvidia-cudnn-cu12==$COLAB_CUDNN"
    sed -i "s/^Requires-Dist: nvidia-cudnn-cu12==.*;/Requires-Dist: nvidia-cudnn-cu12==$COLAB_CUDNN;/" \
        "$1"/lib/python3.13/site-packages/torch-*.dist-info/METADATA
}

run_in_colab_image() {  # NAME NOTEBOOK [WHEEL_DIR]: its cells up to the TE import, in Colab's file system
    local venv=$DIR/venv-$1 work=$DIR/$1
    rm -rf "$work" overlay && mkdir -p "$work"
    unshare -m --propagation private bash -s "$DIR" "$venv" "$work" "$2" "$REPO" "${3:-}" <<'INNER'
set -euo pipefail
DIR=$1 VENV=$2 WORK=$3 NOTEBOOK=$4 REPO=$5 TE_WHEEL_DIR=$6
for mountpoint in /usr/bin /usr/include /usr/lib/x86_64-linux-gnu /usr/local; do
    layer=$DIR/overlay$mountpoint && mkdir -p "$layer/upper" "$layer/work"
    mount -t overlay overlay -o "lowerdir=$DIR/sys$mountpoint:$mountpoint,upperdir=$layer/upper,workdir=$layer/work" "$mountpoint"
done
rm -rf /usr/local/cuda /usr/local/cuda-13.0 /usr/local/bin/nvcc  # this machine's own CUDA 13
rm -f /usr/bin/ninja  # this machine has ninja; Colab has not
ln -s cuda-12.8 /usr/local/cuda
printf 'include /etc/ld.so.conf\n/usr/local/cuda/lib64\n' > "$DIR/overlay/ld.so.conf"
ldconfig -f "$DIR/overlay/ld.so.conf" -C "$DIR/overlay/ld.so.cache"
mount --bind "$DIR/overlay/ld.so.cache" /etc/ld.so.cache
cd "$WORK"
colab() {
    # A fresh runtime has an empty pip cache: no TE wheel built by an earlier phase
    env -i HOME="$HOME" LANG=C.UTF-8 PIP_CONFIG_FILE=/dev/null PIP_CACHE_DIR="$WORK/pip-cache" \
        LD_LIBRARY_PATH=/usr/lib64-nvidia \
        PATH="$VENV/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$@"
}
echo "--- the image"
colab python -c 'import sys, torch; print("Python", sys.version.split()[0], "| torch", torch.__version__, "CUDA", torch.version.cuda, "| torch cuDNN", torch.backends.cudnn.version())'
echo "system cuDNN: $(grep -hE '^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ' /usr/include/cudnn_version.h | awk '{print $3}' | paste -sd.)"
echo "nvcc: $(colab nvcc --version | tail -1)"
echo "NCCL header: $(ls /usr/include/nccl.h)"
echo "ninja: $(colab bash -c 'command -v ninja || echo none')"
colab ${TE_WHEEL_DIR:+TE_WHEEL_DIR="$TE_WHEEL_DIR"} python -u "$REPO/tests/colab_like/run_cells.py" "$NOTEBOOK"
INNER
}

leftovers() {  # compilers and builds still running after the cells returned
    ps -eo pid,etimes,args | grep -E '[c]c1plus|[n]inja -v|[s]etup.py|[b]uild_meta|[p]ip install' || true
}

: > report.txt
say "Colab-like run of $REPO in $DIR, $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
say "assembling the system: CUDA 12.8 toolkit, cuDNN 9.8, NCCL 2.25"
assemble_system >> setup.log 2>&1
PHASES=${PHASES:-before after kept-build kept-reuse}
if [[ " $PHASES " == *" kept-build "* ]]; then
    rm -rf "$DIR/kept-wheels"  # kept-build starts from an empty folder; kept-reuse uses what it kept
fi
for phase in $PHASES; do
    say "$phase: a fresh Python 3.13 venv with $TORCH and cuDNN $COLAB_CUDNN"
    make_venv "$DIR/venv-$phase" >> setup.log 2>&1
    notebook=$REPO/te_fp8_training.ipynb wheel_dir=""
    case $phase in
        before) git -C "$REPO" show "$BEFORE_COMMIT:te_fp8_training.ipynb" > before.ipynb
                notebook=$DIR/before.ipynb ;;
        kept-*) wheel_dir=$DIR/kept-wheels ;;
    esac
    say "$phase: the notebook's cells up to the TE import ($notebook${wheel_dir:+, TE_WHEEL_DIR=$wheel_dir})"
    started=$SECONDS
    run_in_colab_image "$phase" "$notebook" "$wheel_dir" > "$phase.log" 2>&1 || say "$phase: exited with $?"
    say "$phase: $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
    grep -E '^(RESULT|--- code cell .* took|  /|Install|The Transformer|Not installing|No kept)' \
        "$phase.log" | tee -a report.txt
    updates=$( (grep -oE "compiling TE's extension: *[0-9]+%\|[^|]*\| *[0-9]+/[0-9]+" "$phase.log" || true) | sort -u | wc -l)
    say "$phase: $updates distinct progress updates of the compile in its output"
    [[ -z $wheel_dir ]] || say "$phase: kept: $(cd "$wheel_dir" && ls -d */*.whl 2>/dev/null | tr '\n' ' ')"
    cp "$DIR/$phase"/*.log "$DIR/$phase-pip.log" 2>/dev/null || true
    still=$(leftovers)
    if [[ -n $still ]]; then
        say "$phase: still running after the cells returned:" && echo "$still" | tee -a report.txt
        sleep 60 && say "a minute later:" && leftovers | tee -a report.txt
        pkill -f cc1plus || true; pkill -f 'setup.py' || true; pkill -f build_meta || true
    fi
done
say "done"
