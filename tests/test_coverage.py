"""The fallback notice: weights without a native product are reported by the loader, in `inspect`, on the CLI's
stderr and in the app's model panel — checked against `native.PRODUCT_TYPES` (the source of truth), so the same
tests hold before and after new native kernels land (and then list less)."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from engine import cli, ops
from engine.events import EngineConfig
from engine.generate import load
from engine.models.build import load_model
from engine.ops import native
from engine.ops.coverage import product_coverage
from engine.storage.modelfile import open_model
from tests.fixtures import KQUANT_MOE, TINY_MOE, FixtureSpec, fixture_path
from tests.quantized import UD_Q4_K_M, quantized_path

FILES = {"Q4_K_M": lambda: quantized_path(KQUANT_MOE, "Q4_K_M"),
         "UD-Q4_K_M": lambda: quantized_path(KQUANT_MOE, "Q4_K_M", overrides=UD_Q4_K_M, tag="ud"),
         "IQ4_XS": lambda: quantized_path(KQUANT_MOE, "IQ4_XS"),
         "MXFP4_MOE": lambda: quantized_path(KQUANT_MOE, "MXFP4_MOE"),
         "IQ2_XXS": lambda: quantized_path(KQUANT_MOE, "IQ2_XXS")}


def _expected(path: Path) -> tuple[set[str], set[str]]:
    """(types that must be listed, types that may be listed) for a file on a native backend: every product
    weight whose type has no native product must be, and the other weights of a routed-expert stack holding
    one may be (the three projections of a layer's experts run as one kind of product)."""
    native_types = {t.name for t in native.PRODUCT_TYPES} | {"F32"}
    mf = open_model(path)
    must: set[str] = set()
    may: set[str] = set()
    for t in mf.tensors.values():
        if len(t.shape) < 2 or t.name == "token_embd.weight":  # token_embd: row lookups (the head is output.weight)
            continue
        if t.qtype.name not in native_types:
            must.add(t.qtype.name)
            if "_exps." in t.name:
                blk = t.name.rsplit(".", 2)[0] + "."
                may |= {mf.tensors[blk + f"ffn_{p}_exps.weight"].qtype.name for p in ("gate", "up", "down")}
    return must, must | may


@pytest.mark.parametrize("name", list(FILES))
def test_the_notice_lists_the_types_without_native_products(name: str) -> None:
    path = FILES[name]()
    backend = ops.default_backend()
    cov = product_coverage(load_model(open_model(path), n_ctx=64, backend=backend), backend.name)
    listed = {f.qtype for f in cov.fallback}
    must, may = _expected(path)
    assert must <= listed <= may, (listed, must, may)
    assert (cov.notice() is None) == (not must)
    if must:
        assert all(f.qtype in cov.notice() for f in cov.fallback)
        assert 0 < sum(cov.share(f) for f in cov.fallback) <= 1


@pytest.mark.parametrize("spec", [TINY_MOE, FixtureSpec(qtype="Q8_0"), KQUANT_MOE], ids=["F32", "Q8_0", "Q4_K"])
def test_native_types_give_no_notice(spec: FixtureSpec) -> None:
    eng = load(fixture_path(spec), EngineConfig(n_ctx=64))
    assert eng.coverage.fallback == () and eng.coverage.weight_bytes > 0
    assert not any("native" in n for n in eng.notices)


def test_the_torch_backend_reports_nothing() -> None:
    # Nothing on it is native by choice: the notice is about the native path.
    cov = product_coverage(load_model(open_model(FILES["IQ4_XS"]()), n_ctx=64, backend=ops.TORCH), "torch")
    assert cov.fallback == () and cov.notice() is None


def test_inspect_reports_it(capsys: pytest.CaptureFixture[str]) -> None:
    path = FILES["IQ4_XS"]()
    must, may = _expected(path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    listed = {f["type"] for f in info["products"]["fallback"]}
    assert must <= listed <= may
    assert len(info["notices"]) == (1 if must else 0) and all(t in "".join(info["notices"]) for t in must)
    assert cli.main(["inspect", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("products"))
    assert all(t in line for t in must) and ("no native product" in line) == bool(must)


def test_generate_and_serve_print_one_notice_line(capsys: pytest.CaptureFixture[str]) -> None:
    path = FILES["IQ4_XS"]()
    notice = load(path, EngineConfig(n_ctx=64)).coverage.notice()
    must, _ = _expected(path)
    assert cli.main(["generate", str(path), "--prompt-tokens", "1,2,3", "--max-tokens", "2", "--no-mtp",
                     "--ctx", "64", "--json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [ln for ln in err if ln.startswith("note:")] == ([f"note: {notice}"] if must else [])
    with socket.socket() as held:  # the load and its notices, then no server: its port is taken
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        assert cli.main(["serve", str(path), "--ctx", "64", "--port", str(held.getsockname()[1])]) == 1
    err = capsys.readouterr().err.splitlines()
    assert (f"note: {notice}" in err) == bool(must) and "Address already in use" in err[-1]


def test_the_app_shows_it_in_the_model_panel(qtbot, tmp_path: Path) -> None:
    from tests.test_window import _window

    path = FILES["IQ4_XS"]()
    must, _ = _expected(path)
    win = _window(qtbot, tmp_path, str(path))
    assert win.model_info is not None, win.errors
    shown = [n for n in win.model_info.notices if "native" in n]
    assert len(shown) == (1 if must else 0)
    if must:
        assert shown[0] in win.info.text() and all(t in shown[0] for t in must)
