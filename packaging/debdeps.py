"""Debian `Depends` / `Recommends` for a PyInstaller one-folder bundle, read from its ELF files.

`python packaging/debdeps.py BUNDLE_DIR` prints two control-file lines. A shared library that the bundle
carries needs no package. Every other soname its files link (libGL, libEGL, libxcb, glibc, ... which
PyInstaller leaves to the system on purpose, and libraries that were not installed on the build machine) is
mapped to the Debian package that ships it: `dpkg -S` when it is installed here, else the Debian library
naming rule (with a note on stderr). Sonames needed by the program's own load chain (the executable, Python
extension modules, torch, the Qt libraries they link, the X11 platform plugin) give `Depends`; those needed
only by optional Qt plugins (Wayland, EGLFS, GTK theme, ...), which Qt skips when they cannot load, give
`Recommends`. libc6 gets the newest GLIBC symbol version any file asks for.
"""
from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

GLIBC_SONAMES = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libresolv.so.2",
                 "libutil.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
# Sonames whose package name does not follow the naming rule (only needed when not installed here).
PACKAGE_OF = {"libgdk-3.so.0": "libgtk-3-0", "libGLX.so.0": "libglx0", "libOpenGL.so.0": "libopengl0"}
# Qt plugins the app needs to show a window on X11 (Qt falls back to X11/XWayland when Wayland fails).
CORE_PLUGIN_DIRS = ("platforms/libqxcb.so", "xcbglintegrations/")
ELF_MAGIC = b"\x7fELF"


def is_elf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


def readelf(p: Path, flag: str) -> str:
    return subprocess.run(["readelf", flag, "--wide", str(p)], capture_output=True, text=True, check=False).stdout


def needed(p: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf(p, "-d"))


def glibc_version(p: Path) -> tuple[int, ...]:
    versions = [tuple(int(x) for x in v.split(".")) for v in re.findall(r"Name: GLIBC_(\d+(?:\.\d+)+)", readelf(p, "-V"))]
    return max(versions, default=(0,))


def is_root(rel: str) -> bool:
    """Files loaded by path rather than through another file's NEEDED list: the executable, Python extension
    modules, torch's libraries (it dlopens some) and programs, and the X11 platform plugin."""
    name = rel.rsplit("/", 1)[-1]
    if "/plugins/" in rel:
        return any(part in rel for part in CORE_PLUGIN_DIRS)
    return ("/" not in rel or ".cpython-" in name or name.endswith(".abi3.so")
            or rel.startswith(("_internal/torch/lib/", "_internal/torch/bin/")))


@cache
def system_path(soname: str) -> str | None:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
        if m and m.group(1) == soname and ("x86-64" in m.group(2) or "AArch64" in m.group(2)):
            return m.group(3)
    return None


@cache
def package_of(soname: str) -> str:
    if soname in GLIBC_SONAMES:
        return "libc6"
    path = system_path(soname)
    if path:
        resolved = str(Path(path).resolve())
        # dpkg's database may list /lib/... or /usr/lib/... (merged /usr): try every spelling.
        for candidate in dict.fromkeys((path, resolved, resolved.removeprefix("/usr"), "/usr" + path)):
            r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True, check=False)
            if r.returncode == 0:
                return r.stdout.split(":", 1)[0].strip()
    if soname in PACKAGE_OF:
        guess = PACKAGE_OF[soname]
    else:  # Debian policy 8.1: libfoo.so.N -> libfooN; libfoo2.so.N -> libfoo2-N
        m = re.fullmatch(r"(lib[^/]+?)\.so\.(\d+)", soname)
        if not m:
            raise SystemExit(f"debdeps: cannot tell which Debian package ships {soname}")
        name, ver = m.group(1).lower(), m.group(2)
        guess = f"{name}-{ver}" if name[-1].isdigit() else f"{name}{ver}"
    print(f"debdeps: note: {soname} is not installed on this machine; assuming package {guess}", file=sys.stderr)
    return guess


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python packaging/debdeps.py BUNDLE_DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
             if p.is_file() and not p.is_symlink() and is_elf(p)}
    by_name: dict[str, list[str]] = {}
    for rel, p in files.items():
        by_name.setdefault(p.name, []).append(rel)
    carried = {p.name for p in root.rglob("*")}
    links = {rel: needed(p) for rel, p in files.items()}
    # The load chain: roots plus every bundled library reachable from them through NEEDED.
    chain: set[str] = set()
    todo = [rel for rel in files if is_root(rel)]
    while todo:
        rel = todo.pop()
        if rel not in chain:
            chain.add(rel)
            todo.extend(r for soname in links[rel] for r in by_name.get(soname, []))
    core: set[str] = set()
    optional: set[str] = set()
    glibc: tuple[int, ...] = (0,)
    for rel, p in files.items():
        outside = {s for s in links[rel] if s not in carried}
        (core if rel in chain else optional).update(outside)
        glibc = max(glibc, glibc_version(p))
    depends = {package_of(s) for s in core}
    recommends = {package_of(s) for s in optional} - depends
    libc = f"libc6 (>= {'.'.join(map(str, glibc))})" if glibc > (0,) else "libc6"
    print("Depends: " + ", ".join([libc] + sorted(depends - {"libc6"})))
    if recommends:
        print("Recommends: " + ", ".join(sorted(recommends)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
