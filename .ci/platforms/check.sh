#!/usr/bin/env bash
# nb_dist on a platform's versions: bash .ci/platforms/check.sh kaggle|colab [--download DIR]
#
# With --download DIR it only downloads the profile's wheels into DIR (torch's CUDA build is
# gigabytes: .ci/run does this in the background while the suite runs); a later check takes
# them from there when PROFILE_WHEELS=DIR is set.
#
# 1. A fresh venv of the platform's Python (pyenv) gets the platform's packages, exactly as
#    .ci/platforms/NAME.txt pins them (make_profile.py writes it from the platform's freeze).
# 2. nb_dist is installed the way a user would: `pip install` with its dependencies. If pip
#    changed any package the platform had, this fails: on Colab that breaks the runtime.
# 3. The test tools the platform lacks, and Ray, come in held to its versions (the same check).
# 4. The kernel-level tests and every notebook, top to bottom under nbval, run there.
set -euo pipefail
cd "$(dirname "$0")/../.."

name=${1:?usage: .ci/platforms/check.sh kaggle|colab [--download DIR]}
profile=.ci/platforms/$name.txt
version=$(sed -nE 's/^# python-version: ([0-9.]+)$/\1/p' "$profile")
started=$SECONDS

# The platform's Python: pyenv's newest build of that minor version, else pythonX.Y on PATH.
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
build=$(ls -d "$root"/versions/"$version".* 2>/dev/null | sort -V | tail -n 1 || true)
python=""
if [ -n "$build" ] && [ -x "$build/bin/python" ]; then python="$build/bin/python"; fi
if [ -z "$python" ]; then python=$(command -v "python$version" || true); fi
if [ -z "$python" ]; then
    echo "The $name profile needs Python $version (pyenv install $version, or python$version on PATH)." >&2
    exit 1
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "${2:-}" = --download ]; then
    "$python" -m pip download --quiet --dest "${3:?--download needs a folder}" -r "$profile"
    echo "== $name profile: wheels downloaded in $((SECONDS - started)) s"
    exit 0
fi
if [ -n "${PROFILE_WHEELS:-}" ]; then
    export PIP_FIND_LINKS="$PROFILE_WHEELS ${PIP_FIND_LINKS:-}"
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$python" -m venv "$scratch/venv"
py="$scratch/venv/bin/python"
echo "== $name profile: Python $("$py" -c 'import platform; print(platform.python_version())'), $(grep -c '==' "$profile") packages"
"$py" -m pip install --quiet -r "$profile"
"$py" .ci/platforms/unchanged.py --record "$scratch/platform.txt"
echo "   platform installed: $((SECONDS - started)) s"

# A user's `pip install nb_dist` (here from this tree, not editable).
"$py" -m pip install --quiet .
"$py" .ci/platforms/unchanged.py "$scratch/platform.txt" --after "pip install nb_dist"
# The test tools the platform does not ship, and Ray (notebook 07 starts a Ray cluster; users
# add it with nb-dist[ray]), at versions that fit the platform's packages.
"$py" -m pip install --quiet -c "$profile" "pytest-timeout>=2.2" "nbval>=0.11" "ray>=2.9"
"$py" .ci/platforms/unchanged.py "$scratch/platform.txt" --after "installing the test tools and Ray"
"$py" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(torch|ipykernel|ipython|ipywidgets|traitlets|jupyter_client|accelerate|transformers|nb.dist|nbval|ray)==' \
    || true
echo "   nb_dist installed, nothing of the platform changed: $((SECONDS - started)) s"

# The kernel-level tests: launch, failures, hangs and stacks, live ranks, the monitor and the
# views, the debugger, scripts and %torchrun, warm imports, Accelerate, torch's privates and
# the older names of its collectives, every exercise of the student edition; then every
# notebook of the solutions edition top to bottom (pyproject.toml's nbval settings).
"$py" -m pytest \
    tests/test_kernel.py tests/test_failures.py tests/test_hangs.py tests/test_output.py \
    tests/test_ranks_kernel.py tests/test_monitor.py tests/test_views.py tests/test_debug.py \
    tests/test_scripts.py tests/test_warm.py tests/test_accelerate_compat.py \
    tests/test_torch_hooks.py tests/test_torch_versions.py tests/test_exercises.py \
    notebooks/*.ipynb
echo "== $name profile passed in $((SECONDS - started)) s"
