"""The installer (packaging/build.sh): build the packages from this checkout, unpack the .deb into a temporary
root, and run the frozen app's smoke test from there, offscreen, with a clean environment and no GPU.

Slow (marked `slow`; `make test` and CI run it): one PyInstaller build plus dpkg-deb and the tarball, then the
smoke test. How long it takes from a fresh clone is measured by `python bench/packaging.py --pytest` (key
`slow_test` in bench/results/packaging.json, rendered in packaging/README.md).
The frozen app must answer with the embedded model, resources/models/*.gguf (the file the app opens by default,
engine.storage.modelfile.default_model_path): "What is 2 plus 3?" -> a reply containing 5. There is no fallback to a
test fixture: without an embedded model the test fails and says so.
"""
from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
TOOLS = ("dpkg", "dpkg-deb", "tar", "gzip", "readelf", "objdump", "ldd", "ldconfig", "strip")


def _require_prerequisites() -> None:
    """Missing tools or packages are a failure with a clear message, never a skip."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    assert not missing, f"packaging needs {', '.join(missing)} (Debian: apt-get install dpkg binutils tar gzip libc-bin)"
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        pytest.fail("PyInstaller is not installed in this interpreter: pip install -e '.[test]' (or '.[packaging]')")


def _clean_env(tmp: Path) -> dict[str, str]:
    """What a user's desktop session would give the app: no venv, no repository on the path, no GPU, and
    home/cache folders inside the test's temporary directory."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "QT_", "LD_", "PYINSTALLER"))}
    home = tmp / "home"
    home.mkdir()
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               QT_QPA_PLATFORM="offscreen", CUDA_VISIBLE_DEVICES="")
    return env


@pytest.mark.slow
def test_deb_unpacks_and_frozen_app_answers(tmp_path: Path) -> None:
    _require_prerequisites()
    dist = tmp_path / "dist"
    env = dict(os.environ, PYTHON=sys.executable, FORETELL_DIST=str(dist))
    embedded = sorted((ROOT / "resources" / "models").glob("*.gguf"))
    assert embedded, ("resources/models/ has no *.gguf: the package must ship the embedded model (train it with "
                      "python -m engine.training.train, see resources/models/README.md); this test never substitutes "
                      "a fixture")

    t0 = time.monotonic()
    build = subprocess.run(["bash", str(ROOT / "packaging" / "build.sh")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1800)
    build_s = time.monotonic() - t0
    assert build.returncode == 0, f"build.sh failed (exit {build.returncode}):\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"

    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    deb = dist / f"foretell_{VERSION}_{arch}.deb"
    tarball = dist / f"foretell-{VERSION}-linux-{os.uname().machine}.tar.gz"
    assert deb.is_file() and tarball.is_file(), f"expected {deb.name} and {tarball.name} in {sorted(os.listdir(dist))}"

    # The control data: name, version from pyproject.toml, declared system libraries.
    control = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"^([\w-]+): (.*)$", control, re.M))
    assert fields["Package"] == "foretell" and fields["Version"] == VERSION and fields["Architecture"] == arch
    assert "libc6 (>= " in fields["Depends"] and "libgl1" in fields["Depends"], fields["Depends"]

    # Install into a temporary root: the layout a user gets under /.
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    app = root / "opt" / "foretell" / "foretell"
    assert app.is_file() and os.access(app, os.X_OK), "no executable /opt/foretell/foretell in the .deb"
    launcher = root / "usr" / "bin" / "foretell"
    assert os.access(launcher, os.X_OK) and "exec /opt/foretell/foretell" in launcher.read_text()
    desktop = configparser.ConfigParser(interpolation=None)
    desktop.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    desktop.read(root / "usr" / "share" / "applications" / "foretell.desktop")
    entry = desktop["Desktop Entry"]
    assert entry["Exec"].split()[0] == "foretell" and entry["Icon"] == "foretell" and entry["Type"] == "Application"
    icon = root / "usr" / "share" / "icons" / "hicolor" / "256x256" / "apps" / "foretell.png"
    assert icon.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    internal = root / "opt" / "foretell" / "_internal"
    shipped = sorted((internal / "resources" / "models").glob("*.gguf"))
    # The app's default model (the last by name) and nothing else: the frozen smoke test answers with this file.
    assert [p.name for p in shipped] == [embedded[-1].name], f"bundle models {shipped}, expected {embedded[-1].name}"
    assert shipped[0].read_bytes()[:4] == b"GGUF", f"{shipped[0]} is not a GGUF file"
    # CPU-only: no CUDA runtime may ride along (the build machine may have one installed).
    cuda = [p.name for p in internal.rglob("*") if re.match(r"lib(cudart|cublas|cudnn|cuda|nccl)\b", p.name)]
    assert not cuda, f"CUDA libraries in the CPU build: {cuda}"

    # The portable tarball holds the same app folder.
    listing = subprocess.run(["tar", "-tzf", str(tarball)], capture_output=True, text=True, check=True).stdout.split()
    assert f"foretell-{VERSION}/foretell" in listing
    assert any(re.fullmatch(rf"foretell-{VERSION}/_internal/resources/models/[^/]+\.gguf", n) for n in listing)

    # The smoke test, from outside the repository: open the window, load the embedded model, answer, exit 0.
    data = tmp_path / "data"
    data.mkdir()
    (data / "settings.ini").write_text("[General]\nmax_tokens=32\n")  # bound the reply, whatever the model
    shot = tmp_path / "shot.png"
    t1 = time.monotonic()
    run = subprocess.run([str(app), "--smoke-test", "--prompt", "What is 2 plus 3?", "--screenshot", str(shot),
                          "--data-dir", str(data), "--timeout", "240"],
                         cwd=tmp_path, env=_clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    smoke_s = time.monotonic() - t1
    assert run.returncode == 0, f"frozen smoke test failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    m = re.search(r"smoke test: (\d+) characters of reply", run.stdout)
    assert m and int(m.group(1)) > 0, f"no reply in the smoke test output:\n{run.stdout[-2000:]}"
    assert "5" in run.stdout.split("smoke test reply:", 1)[1], run.stdout[-1000:]  # the embedded model answered
    m = re.search(r"smoke test: kernels: (.+)", run.stdout)
    assert m and m.group(1).strip().startswith("native-"), f"the native library is missing from the frozen app:\n{run.stdout[-2000:]}"
    assert shot.stat().st_size > 10_000, "the screenshot is missing or empty"
    assert (data / "conversations.sqlite3").is_file(), "the conversation was not stored in --data-dir"
    print(f"build {build_s:.0f} s, smoke test {smoke_s:.1f} s; .deb {deb.stat().st_size / 2**20:.0f} MiB, "
          f".tar.gz {tarball.stat().st_size / 2**20:.0f} MiB")
