# Sourced by the GPU scripts (`bash bench/NAME.sh` from a checkout's root), or by hand
# (`. bench/source_path.sh`): makes the checkout importable as the package `headrace` without
# installing it, as on the GPU machine, which has no network for a build backend. The package's
# subpackages are the checkout's top-level folders (pyproject's package-dir), so a folder of
# symbolic links stands for the installed package: headrace/ = protos/headrace's files (the
# namespace's root, the generated gRPC code) and one link per folder. It goes first on
# PYTHONPATH; the checkout's root (tests, bench) last.
headrace_view="${TMPDIR:-/tmp}/headrace-view-$$"
rm -rf "$headrace_view" && mkdir -p "$headrace_view/headrace"
ln -s "$PWD"/protos/headrace/* "$headrace_view/headrace/"
for headrace_dir in cli client common controlplane dataplane kernels; do
  ln -s "$PWD/$headrace_dir" "$headrace_view/headrace/$headrace_dir"
done
export PYTHONPATH="$headrace_view${PYTHONPATH:+:$PYTHONPATH}:$PWD"
unset headrace_dir
