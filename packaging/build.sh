#!/usr/bin/env bash
# Build the Foretell Linux packages from this checkout:
#   1. PyInstaller one-folder app (CPU torch + the embedded model)   build/packaging/app/foretell/
#   2. Debian package, installs to /opt/foretell + /usr/bin/foretell  dist/foretell_VERSION_ARCH.deb
#   3. portable tarball of the same folder                            dist/foretell-VERSION-linux-MACHINE.tar.gz
# Environment (all optional):
#   PYTHON           interpreter with the project and its `packaging` extra installed (default: .venv/bin/python)
#   FORETELL_MODEL   GGUF to embed (default: the app's embedded model, engine.storage.modelfile.default_model_path())
#   DEB_COMPRESSION  dpkg-deb compressor: zstd (default: fastest), xz (smallest, slowest: for releases), gzip, none;
#                    measured in bench/results/packaging.json (deb_compressors), see packaging/README.md
#   FORETELL_DIST    output folder for the packages (default: dist/)
#   FORETELL_CLEAN   1: remove the previous build (PyInstaller's cache in build/packaging/) first
# See packaging/README.md for what it makes, sizes and timings.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
DIST="${FORETELL_DIST:-$ROOT/dist}"
DEB_COMPRESSION="${DEB_COMPRESSION:-zstd}"
WORK="$ROOT/build/packaging"

die() { echo "build.sh: error: $*" >&2; exit 1; }
step() { echo "build.sh: [$(( SECONDS - START ))s] $*"; }
START=$SECONDS

# --- prerequisites -----------------------------------------------------------------------------------
[[ "$(uname -s)" == Linux ]] || die "this script builds Linux packages; for Windows/macOS see packaging/README.md"
for tool in dpkg dpkg-deb tar gzip readelf objdump ldd ldconfig strip flock; do
    command -v "$tool" >/dev/null || die "'$tool' is missing (Debian: apt-get install dpkg binutils tar gzip libc-bin util-linux)"
done
case "$DEB_COMPRESSION" in  # dpkg-deb compresses with its own libraries: no extra tool needed
    zstd|gzip|xz|none) ;;
    *) die "DEB_COMPRESSION must be zstd, gzip, xz or none (got '$DEB_COMPRESSION')" ;;
esac
[[ -x "$PYTHON" ]] || die "no Python at $PYTHON: run 'make setup' (or set PYTHON to an interpreter with the project installed)"
"$PYTHON" - <<'EOF' || die "the build interpreter $PYTHON is not ready (see the line above)"
import importlib.util, sys
missing = [m for m in ("PyInstaller", "PySide6", "torch", "engine", "app") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing modules: {', '.join(missing)}; install with: pip install -e '.[packaging]'")
import torch
if torch.version.cuda or torch.version.hip:
    sys.exit(f"torch {torch.__version__} is a GPU build; the package ships the CPU wheel (torch==2.13.0+cpu)")
EOF

if [[ -z "${FORETELL_MODEL:-}" ]]; then
    # The same file the app opens from a checkout (engine.storage.modelfile.default_model_path: the last
    # resources/models/*.gguf by name), so the package ships what the tests ran against.
    FORETELL_MODEL="$("$PYTHON" - <<'PY'
import sys
from engine.errors import EngineError
from engine.storage.modelfile import default_model_path
try:
    print(default_model_path())
except EngineError as e:
    sys.exit(f"build.sh: {e}")
PY
)" || die "no embedded model to ship: resources/models/*.gguf is missing; set FORETELL_MODEL=path/to/model.gguf"
fi
[[ -f "$FORETELL_MODEL" ]] || die "FORETELL_MODEL=$FORETELL_MODEL is not a file"
FORETELL_MODEL="$(cd "$(dirname "$FORETELL_MODEL")" && pwd)/$(basename "$FORETELL_MODEL")"
export FORETELL_MODEL
[[ -f resources/icons/foretell.png ]] || die "resources/icons/foretell.png is missing (python packaging/make_icon.py draws it)"

VERSION="$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
ARCH="$(dpkg --print-architecture)"
MACHINE="$(uname -m)"
DEB="$DIST/foretell_${VERSION}_${ARCH}.deb"
TARBALL="$DIST/foretell-${VERSION}-linux-${MACHINE}.tar.gz"
step "foretell $VERSION ($ARCH), model $FORETELL_MODEL, python $PYTHON"

# --- 1. the frozen app ---------------------------------------------------------------------------------
mkdir -p "$WORK" "$DIST"
# One build at a time per checkout: two builds (say, the slow test and bench/packaging.py) share $WORK.
exec 9>"$WORK/.lock"
flock -n 9 || { step "waiting for another build.sh in this checkout to finish"; flock 9; }
if [[ "${FORETELL_CLEAN:-0}" == 1 ]]; then  # build as from a fresh clone: no PyInstaller cache
    step "FORETELL_CLEAN=1: removing the previous build in $WORK"
    rm -rf "$WORK/pyinstaller" "$WORK/app" "$WORK/deb-root"
fi
APP="$WORK/app/foretell"
step "PyInstaller (log: $WORK/pyinstaller.log)"
if ! "$PYTHON" -m PyInstaller --noconfirm --log-level WARN --distpath "$WORK/app" --workpath "$WORK/pyinstaller" \
        packaging/foretell.spec >"$WORK/pyinstaller.log" 2>&1; then
    tail -n 30 "$WORK/pyinstaller.log" >&2
    die "PyInstaller failed (full log: $WORK/pyinstaller.log)"
fi
[[ -x "$APP/foretell" ]] || die "PyInstaller made no executable at $APP/foretell"
# torch's libraries keep their full symbol tables (~90 MB in libtorch_cpu.so); the dynamic symbols that
# loading needs stay. Only torch's own libraries: wheel-repaired ones (numpy.libs) can break when stripped.
strip --strip-unneeded "$APP"/_internal/torch/lib/libtorch*.so "$APP"/_internal/torch/lib/libc10.so

# --- 2. the .deb -----------------------------------------------------------------------------------------
step "staging the Debian package"
STAGE="$WORK/deb-root"
rm -rf "$STAGE"
mkdir -p "$STAGE/DEBIAN" "$STAGE/opt" "$STAGE/usr/bin" "$STAGE/usr/share/applications" \
    "$STAGE/usr/share/icons/hicolor/256x256/apps" "$STAGE/usr/share/doc/foretell"
cp -al "$APP" "$STAGE/opt/foretell" 2>/dev/null || cp -a "$APP" "$STAGE/opt/foretell"  # hard links: no 700 MB copy
install -m 0755 packaging/linux/foretell.sh "$STAGE/usr/bin/foretell"
install -m 0644 packaging/linux/foretell.desktop "$STAGE/usr/share/applications/foretell.desktop"
install -m 0644 resources/icons/foretell.png "$STAGE/usr/share/icons/hicolor/256x256/apps/foretell.png"
install -m 0644 packaging/linux/copyright "$STAGE/usr/share/doc/foretell/copyright"
DEPS="$("$PYTHON" packaging/debdeps.py "$APP")" || die "could not work out the package dependencies"
{
    echo "Package: foretell"
    echo "Version: $VERSION"
    echo "Architecture: $ARCH"
    echo "Maintainer: Foretell developers <foretell@users.noreply.github.com>"
    echo "Installed-Size: $(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)"
    echo "$DEPS"
    echo "Section: utils"
    echo "Priority: optional"
    echo "Description: local chat with Qwen3.5/3.6 GGUF models"
    echo " Foretell is a desktop chat app for Qwen3.5/3.6-class GGUF models (qwen35moe, qwen35) with"
    echo " MTP speculative decoding and live metrics. This build runs on the CPU (no GPU needed) and"
    echo " ships a small demonstration model, so it works offline right after installation."
} >"$STAGE/DEBIAN/control"
step "dpkg-deb ($DEB_COMPRESSION)"
dpkg-deb --root-owner-group -Z"$DEB_COMPRESSION" --build "$STAGE" "$DEB" >/dev/null

# --- 3. the portable tarball ---------------------------------------------------------------------------
step "portable tarball"
tar --create --gzip --file "$TARBALL" --owner=0 --group=0 --numeric-owner --sort=name \
    --directory "$WORK/app" --transform "s,^foretell,foretell-$VERSION," foretell

step "done"
printf '  %-60s %s\n' "$APP/" "$(du -sh "$APP" | cut -f1)" "$DEB" "$(du -h "$DEB" | cut -f1)" \
    "$TARBALL" "$(du -h "$TARBALL" | cut -f1)"
