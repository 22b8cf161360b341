"""Packaging numbers: build time, package sizes and start-up time of the frozen app.

    python bench/packaging.py [--no-build] [--runs 5] [--compressors] [--out bench/results/packaging.json]

Runs packaging/build.sh (unless --no-build: then it measures the packages already in dist/), unpacks the
.deb into a temporary root, and starts the frozen app from there `--runs` times with
`--smoke-test` offscreen (reply capped at 16 tokens), timing from process start:
  - `help_s`: `foretell --help` to exit (bootloader + Python start, no Qt/torch),
  - `imports_s`, `window_shown_s`, `model_loaded_s`: milestones printed by the entry script
    (FORETELL_STARTUP_TRACE=1, see packaging/foretell_entry.py), timed by this script as the lines arrive,
  - `reply_s`: the smoke test's exit, after the reply arrived.
The first run follows the unpacking (files are in the page cache, as right after installation; this script
does not drop the kernel's caches, which would disturb other work on the machine). The same smoke test from
source (`python -m app.main`) is timed for comparison. --compressors re-packs the staged .deb tree with each
dpkg-deb compressor and records size and time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MILESTONES = ("imports", "window-shown", "model-loaded")


def du_bytes(path: Path) -> int:
    """Apparent size of a tree (sum of file sizes), as a user sees it installed."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def timed_start(cmd: list[str], env: dict[str, str], cwd: Path) -> dict[str, float | int | str]:
    """Run one start-up, time each trace line on arrival, return milestones (s from process start)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict[str, float | int | str] = {}
    assert proc.stderr is not None and proc.stdout is not None
    err_tail: list[str] = []
    for line in proc.stderr:  # trace lines are flushed one by one; stdout is read after exit
        m = re.match(r"startup-trace: (\S+) ", line)
        if m:
            out[m.group(1).replace("-", "_") + "_s"] = round(time.monotonic() - t0, 3)
        else:
            err_tail = (err_tail + [line.rstrip()])[-5:]
    stdout = proc.stdout.read()
    rc = proc.wait()
    out["reply_s"] = round(time.monotonic() - t0, 3)
    out["rc"] = rc
    m = re.search(r"smoke test: (\d+) characters of reply.*?ttft_s=([\d.]+).*?elapsed_s=([\d.]+)", stdout)
    if rc != 0 or not m:
        raise SystemExit(f"start-up run failed (exit {rc}): {' '.join(cmd)}\n{stdout[-1500:]}\n" + "\n".join(err_tail))
    out["reply_chars"], out["ttft_s"], out["generation_s"] = int(m.group(1)), float(m.group(2)), float(m.group(3))
    return out


def summarize(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k.endswith("_s")]
    return {"first": runs[0], "median_of_rest": {k: round(statistics.median(r[k] for r in runs[1:]), 3) for k in keys}
            if len(runs) > 1 else None, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-build", action="store_true", help="measure the packages already in dist/")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compressors", action="store_true", help="also time each dpkg-deb compressor")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "packaging.json"))
    args = ap.parse_args()

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    dist = ROOT / "dist"
    deb = dist / f"foretell_{version}_{arch}.deb"
    tarball = dist / f"foretell-{version}-linux-{platform.machine()}.tar.gz"
    result: dict = {
        "command": "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    build_env = dict(os.environ, PYTHON=os.environ.get("PYTHON", sys.executable))
    if not args.no_build:
        t0 = time.monotonic()
        subprocess.run(["bash", str(ROOT / "packaging" / "build.sh")], cwd=ROOT, env=build_env, check=True)
        result["build_s"] = round(time.monotonic() - t0, 1)
    for p in (deb, tarball):
        if not p.is_file():
            raise SystemExit(f"{p} is missing: run packaging/build.sh (or drop --no-build)")

    fields = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
    control = dict(re.findall(r"^([\w-]+): (.*)$", fields, re.M))
    models = sorted((ROOT / "build" / "packaging" / "app" / "foretell" / "_internal" / "resources" / "models").glob("*.gguf"))
    result["package"] = {"version": version, "depends": control.get("Depends"), "recommends": control.get("Recommends"),
                         "embedded_model": models[0].name if models else None,
                         "embedded_model_bytes": models[0].stat().st_size if models else None}

    with tempfile.TemporaryDirectory(prefix="foretell-bench-") as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.monotonic()
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
        unpack_s = time.monotonic() - t0
        app_dir = tmp / "root" / "opt" / "foretell"
        internal = app_dir / "_internal"
        biggest = sorted(((du_bytes(p) if p.is_dir() else p.stat().st_size, p.name) for p in internal.iterdir()), reverse=True)
        result["sizes_bytes"] = {
            "deb": deb.stat().st_size, "tar_gz": tarball.stat().st_size, "installed_opt_foretell": du_bytes(app_dir),
            "installed_size_field_kib": int(control["Installed-Size"]),
            "largest_in_internal": {name: size for size, name in biggest[:8]},
            "libtorch_cpu_so": (internal / "torch" / "lib" / "libtorch_cpu.so").stat().st_size,
        }
        result["unpack_deb_s"] = round(unpack_s, 1)

        data = tmp / "data"
        data.mkdir()
        (data / "settings.ini").write_text("[General]\nmax_tokens=16\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "QT_"))}
        env.update(QT_QPA_PLATFORM="offscreen", FORETELL_STARTUP_TRACE="1", PATH="/usr/local/bin:/usr/bin:/bin")
        smoke = ["--smoke-test", "--prompt", "What is 2 plus 3?", "--data-dir", str(data)]
        frozen = str(app_dir / "foretell")
        help_runs = []
        for _ in range(3):
            t0 = time.monotonic()
            subprocess.run([frozen, "--help"], env=env, cwd=tmp, check=True, capture_output=True)
            help_runs.append(time.monotonic() - t0)
        runs = [timed_start([frozen, *smoke], env, tmp) for _ in range(args.runs)]
        result["start_frozen"] = {"help_s": round(min(help_runs), 3), **summarize(runs)}
        # From source, for comparison: same smoke test, no trace milestones (the entry script is not used).
        src_env = dict(env, PYTHONPATH=str(ROOT))
        source = [timed_start([sys.executable, "-m", "app.main", *smoke], src_env, tmp) for _ in range(3)]
        result["start_source"] = summarize(source)

    if args.compressors:
        stage = ROOT / "build" / "packaging" / "deb-root"
        comp = {}
        with tempfile.TemporaryDirectory(prefix="foretell-comp-") as tmp_s:
            for name, level in (("gzip", "6"), ("xz", "6"), ("zstd", "3"), ("zstd", "19")):
                out = Path(tmp_s) / f"{name}{level}.deb"
                t0 = time.monotonic()
                subprocess.run(["dpkg-deb", "--root-owner-group", f"-Z{name}", f"-z{level}", "--build", str(stage),
                                str(out)], check=True, capture_output=True)
                comp[f"{name} -{level}"] = {"seconds": round(time.monotonic() - t0, 1), "bytes": out.stat().st_size}
                out.unlink()
        result["deb_compressors"] = comp

    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("sizes_bytes", "build_s") if k in result}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
