#!/usr/bin/env bash
# GPU tests against ref_kernels/fa3_sm90 with A/B patches applied, in a temporary copy of the
# package, kernels and tests (the checkout is left alone; the compile cache keys on the source, so
# patched cubins never mix with the product's).
#
#   usage (repo root):  bash experiments/patched_gpu_tests.sh PATCH[+PATCH...] [PYTEST ARGS...]
#   e.g.  bash experiments/patched_gpu_tests.sh kv_rotate tests/gpu/test_fa3_sm90.py -k full -q
#
# PATCH names experiments/patches/PATCH.patch (knobs/NAME too). Exit status: pytest's, or 2 when a
# patch is missing or does not apply.
set -uo pipefail
names=${1:?"usage: patched_gpu_tests.sh PATCH[+PATCH...] [PYTEST ARGS...]"}; shift
root=$PWD
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp -r "$root/cubridge" "$root/ref_kernels" "$root/tests" "$root/pyproject.toml" "$tmp"/
for name in ${names//+/ }; do
  patch_file="$root/experiments/patches/$name.patch"
  if [ ! -f "$patch_file" ]; then
    echo "error: experiments/patches/$name.patch: no such patch"; exit 2
  fi
  if command -v patch >/dev/null; then
    (cd "$tmp" && patch -p1 --forward -s --no-backup-if-mismatch -i "$patch_file")
  else
    (cd "$tmp" && git apply -p1 --unsafe-paths "$patch_file")
  fi || { echo "error: experiments/patches/$name.patch does not apply to ref_kernels/fa3_sm90"; exit 2; }
  echo "applied experiments/patches/$name.patch"
done
cd "$tmp" && PYTHONPATH="$tmp" python3 -m pytest "$@"
