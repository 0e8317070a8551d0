# Sourced by the GPU scripts (`bash bench/NAME.sh` from a checkout's root), or by hand
# (`. bench/source_path.sh`): makes the checkout importable as the package `headrace` without
# installing it, as on the GPU machine, which has no network for a build backend. The package's
# subpackages are the checkout's top-level folders (pyproject's package-dir), so a folder of
# symbolic links stands for the installed package: headrace/ = protos/headrace's root module and
# its generated packages (only folders with an __init__.py: a leftover folder of ignored files,
# such as an old protos/headrace/dataplane/ holding __pycache__, would stand in for the data
# plane) and one link per top-level folder. It goes first on PYTHONPATH; the checkout's root
# (tests, bench) last.
headrace_view="$(mktemp -d "${TMPDIR:-/tmp}/headrace-view.XXXXXX")"
mkdir -p "$headrace_view/headrace"
for headrace_dir in "$PWD"/protos/headrace/*; do
  if [ "${headrace_dir##*/}" = __init__.py ] || [ -f "$headrace_dir/__init__.py" ]; then
    ln -s "$headrace_dir" "$headrace_view/headrace/"
  fi
done
for headrace_dir in cli client common controlplane dataplane kernels; do
  ln -sfn "$PWD/$headrace_dir" "$headrace_view/headrace/$headrace_dir"
done
export PYTHONPATH="$headrace_view${PYTHONPATH:+:$PYTHONPATH}:$PWD"
unset headrace_dir
