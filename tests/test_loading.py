"""Loading at scale (issue 24): progress while a model is prepared, cancelling it, and the memory plan that keeps
weights mapped when a model (nearly) fills the RAM available (tested with a memory budget, not a big machine)."""
from __future__ import annotations

import threading

import pytest

from engine.errors import InvalidParameterError, LoadCancelled
from engine.events import EngineConfig, GenerationConfig
from engine.generate import load
from engine.memory import GIB, plan_memory
from engine.sampling import SamplingConfig
from tests.fixtures import KQUANT_MOE, fixture_path

GREEDY = GenerationConfig(max_tokens=8, sampling=SamplingConfig(temperature=0.0, top_k=1), mtp=False)


def _tokens(eng) -> list[int]:  # type: ignore[no-untyped-def]
    return [i for ev in eng.generate("The quick brown fox", GREEDY) if hasattr(ev, "ids") for i in ev.ids]


def test_progress_moves_through_every_layer_to_ready() -> None:
    seen: list[tuple[float, str]] = []
    eng = load(fixture_path(KQUANT_MOE), EngineConfig(n_ctx=128), progress=lambda f, m: seen.append((f, m)))
    fracs = [f for f, _ in seen]
    assert fracs == sorted(fracs) and fracs[0] == 0.0 and fracs[-1] == 1.0
    total = eng.hp.n_layer + 1  # and the MTP block
    layer_msgs = [m for _, m in seen if m.startswith("preparing layer")]
    assert layer_msgs[-1] == f"preparing layer {total} of {total}" and len(layer_msgs) == total + 1
    assert any(m == "reading the tokenizer" for _, m in seen)


@pytest.mark.parametrize("at", ["before", "layer 2"])
def test_cancel_stops_loading_with_a_typed_error(at: str) -> None:
    cancel = threading.Event()
    layers: list[str] = []

    def progress(f: float, m: str) -> None:
        if m.startswith("preparing layer"):
            layers.append(m)
        if m == "preparing layer 2 of 5":
            cancel.set()

    if at == "before":
        cancel.set()
    with pytest.raises(LoadCancelled, match="cancelled"):
        load(fixture_path(KQUANT_MOE), EngineConfig(n_ctx=128), progress=progress, cancel=cancel)
    assert layers == ([] if at == "before" else [f"preparing layer {i} of 5" for i in range(3)])


def test_memory_plan_regimes() -> None:
    fits = plan_memory("m.gguf", 4 * GIB, GIB // 2, 16 * GIB, GIB, True)
    assert fits.copies and fits.notice is None
    tight = plan_memory("m.gguf", 14 * GIB, GIB, 16 * GIB, GIB, True)
    assert not tight.copies and "stay mapped" in tight.notice and "packed" in tight.notice  # type: ignore[operator]
    assert "packed" not in plan_memory("m.gguf", 14 * GIB, GIB, 16 * GIB, GIB, False).notice  # type: ignore[operator]
    over = plan_memory("m.gguf", 20 * GIB, GIB, 16 * GIB, 2 * GIB, False)
    assert not over.copies and "page cache" in over.notice and "2.0 GiB" in over.notice  # type: ignore[operator]
    # the draft head's sketch comes on top of the weights: counted where copies are decided
    assert plan_memory("m.gguf", 12 * GIB, GIB, 16 * GIB, GIB, True).copies
    with_sketch = plan_memory("m.gguf", 12 * GIB, GIB, 16 * GIB, GIB, True, extra_bytes=2 * GIB)
    assert not with_sketch.copies and "stay mapped" in with_sketch.notice  # type: ignore[operator]


def test_sketch_bytes_are_those_the_sketch_takes() -> None:
    """A 248k × 4096 head (Qwen3.5's vocabulary) gets a sketch of ~0.3 GB; a small or odd-width head none."""
    from engine import ops

    assert ops.sketch_bytes(248320, 4096, 835 << 20) == 248320 * (1024 + 32 * 4)
    assert ops.sketch_bytes(8192, 256, 2 << 20) == 0
    assert ops.sketch_bytes(248320, 4100, 835 << 20) == 0


def _stacked(eng) -> int:  # type: ignore[no-untyped-def]
    """Stacked copies the layers' small projections made (ops.linear_many)."""
    n = 0
    for layer in eng.model.layers:
        for lin in vars(layer.mixer.w).values():
            n += sum(v is not None for v in getattr(lin, "stacks", {}).values())
    return n


def test_a_model_over_the_memory_budget_stays_mapped_and_decodes_the_same_tokens() -> None:
    roomy = load(fixture_path(KQUANT_MOE), EngineConfig(n_ctx=128))
    want = _tokens(roomy)
    assert roomy.memory.copies and not roomy.notices and _stacked(roomy) > 0
    small = load(fixture_path(KQUANT_MOE), EngineConfig(n_ctx=128, memory_budget=roomy.mf.file_size // 2))
    assert not small.memory.copies and not small.model.layers[0].mixer.backend.copies
    assert any("page cache" in n for n in small.notices)
    assert _tokens(small) == want  # rows are independent: stacked or not, the same bits
    assert _stacked(small) == 0  # no anonymous copies of weights were made


def test_memory_budget_is_validated() -> None:
    with pytest.raises(InvalidParameterError, match="memory budget"):
        load(fixture_path(KQUANT_MOE), EngineConfig(memory_budget=0))
