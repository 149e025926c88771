#!/usr/bin/env bash
# Tandem used from outside its tree (issue 18), installed one of two ways:
#   bash tests/install/run.sh <build dir> prefix   `cmake --install` into a fresh prefix
#   bash tests/install/run.sh <build dir> deb      `cpack -G DEB`, then `dpkg -i` (root only; exits 77, skipped,
#                                                  otherwise), removed again (`dpkg -r`) at the end
# Either way it checks the installed tree (headers under include/tandem/<module>/, no detail/ header, the package
# files, tandem-run, the Python client), then configures, builds and runs tests/install/consumer against it: two workers started by the
# installed tandem-run call each other and fetch an RRef.
set -euo pipefail
build="$(cd "$1" && pwd)"
how="$2"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d /tmp/tandem-install.XXXXXX)"
cleanup() {
  rm -rf "$work"
  if [ "$how" = deb ] && [ -n "${installed:-}" ]; then dpkg -r libtandem-dev >/dev/null; fi
}
trap cleanup EXIT

case "$how" in
  prefix)
    prefix="$work/prefix"
    cmake --install "$build" --prefix "$prefix" >"$work/install.log"
    prefix_path=("-DCMAKE_PREFIX_PATH=$prefix") ;;
  deb)
    if [ "$(id -u)" != 0 ]; then echo "install: the package test installs a .deb and needs root; skipped" >&2; exit 77; fi
    if dpkg-query -W -f='${Status}' libtandem-dev 2>/dev/null | grep -q 'ok installed'; then
      echo "install: libtandem-dev is installed already; not replacing it" >&2; exit 1
    fi
    (cd "$build" && cpack -G DEB -B "$work/deb" >"$work/cpack.log") || { cat "$work/cpack.log" >&2; exit 1; }
    deb="$(ls "$work"/deb/libtandem-dev_*.deb)"
    installed=1
    dpkg -i "$deb" >"$work/dpkg.log" 2>&1 || { cat "$work/dpkg.log" >&2; exit 1; }
    dpkg -L libtandem-dev | grep -q '/usr/bin/tandem-run$' || { echo "install: the package has no tandem-run" >&2; exit 1; }
    prefix=/usr
    prefix_path=() ;;  # a system package: found without a hint
  *) echo "usage: run.sh <build dir> prefix|deb" >&2; exit 2 ;;
esac
for f in include/tandem/rpc/rpc.h include/tandem/rref/rref.h include/tandem/ddp/ddp.h include/tandem/sync/sync.h \
         lib/cmake/Tandem/TandemConfig.cmake lib/cmake/Tandem/TandemTargets.cmake lib/libtandem_rpc.a bin/tandem-run; do
  [ -e "$prefix/$f" ] || { echo "install: $f is missing from the installed tree" >&2; exit 1; }
done
if found="$(find "$prefix/include/tandem" -path '*/detail/*')" && [ -n "$found" ]; then
  echo "install: detail/ headers were installed: $found" >&2; exit 1
fi
# Every installed header includes Tandem's headers by their installed path, and only installed ones.
while read -r inc; do
  [ -e "$prefix/include/$inc" ] || { echo "install: an installed header includes \"$inc\", which is not installed" >&2; exit 1; }
done < <(grep -rhoE '#include "tandem/[^"]+"' "$prefix/include/tandem" | sed -E 's/#include "(.*)"/\1/' | sort -u)
if grep -rnE '#include "(rpc|rref|comm|ddp|fsdp|optim|sync|nn|pipeline|dist_autograd|dist_optim|cluster|elastic|checkpoint)/' \
     "$prefix/include/tandem"; then
  echo "install: the headers above include Tandem by a path that is not the installed one" >&2; exit 1
fi

# The consumer sees the prefix and nothing of the source or build tree.
cmake -S "$here/consumer" -B "$work/consumer" "${prefix_path[@]}" -DCMAKE_BUILD_TYPE=Release >"$work/cfg.log" ||
  { cat "$work/cfg.log" >&2; exit 1; }
cmake --build "$work/consumer" -j2 >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
src="$(cd "$here/../.." && pwd)"
if grep -rlF -e "$src" -e "$build" "$work/consumer/CMakeFiles" --include='flags.make' --include='link.txt'; then
  echo "install: the consumer's build reaches into Tandem's tree ($src, $build)" >&2; exit 1
fi
timeout 120 "$prefix/bin/tandem-run" --nproc-per-node 2 "$work/consumer/consumer" | tee "$work/run.log"
[ "$(grep -c ' scale .* rref 10$' "$work/run.log")" = 2 ] || { echo "install: both workers should report" >&2; exit 1; }
# The Python client is installed where Debian's python3 finds system packages, and imports from there.
py_env=(env)
if [ "$how" = prefix ]; then py_env=(env PYTHONPATH="$prefix/lib/python3/dist-packages"); fi
"${py_env[@]}" /usr/bin/python3 -c "
import sys, tandem_client
want = '$prefix/lib/python3/dist-packages/tandem_client/'
sys.exit(0 if tandem_client.__file__.startswith(want) else 'install: tandem_client imported from ' + tandem_client.__file__)"
echo "install: a project outside the tree built and ran against Tandem installed in $prefix ($how)"
