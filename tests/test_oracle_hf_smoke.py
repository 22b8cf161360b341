"""HF transformers → our GGUF conversion → llama.cpp: the two reference implementations must agree.

A tiny random Qwen3.5 text model (HF `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM`) is converted with
the spec §2 transforms in `tests/oracle_hf.py` and written by `engine.storage.writer`. llama.cpp (F32 weights,
F32 KV cache) must then reproduce HF's logits. Measured max |Δlogit| is 3e-5…1.5e-4 for logits of
std ≈ 4 (float32 rounding only); an F16 KV cache alone would add ≈ 1.7e-3, hence type_k/type_v = F32.
Any convention error (V-head order, 1+w norms, …) moves logits by O(10), see the negative controls.
"""
from __future__ import annotations

import llama_cpp  # oracles are test dependencies (pyproject [test]); never skipped
import numpy as np
import pytest

from engine.storage.modelfile import open_model
from tests.oracle_hf import build_hf_model, hf_logits, hf_to_gguf, tiny_hf_config

TOL = 1e-3  # max |Δlogit|, F32 weights and F32 KV cache on both sides
GGML_TYPE_F32 = 0
N_TOKENS = 64


def llama_cpp_logits(path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True, n_threads=2,
        verbose=False, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


_CACHE: dict[str, tuple] = {}


def _build(arch: str, tmp_path_factory) -> tuple:
    """(arch, config, HF model, tokens, converted GGUF path, HF logits), built once per arch."""
    if arch not in _CACHE:
        cfg = tiny_hf_config(arch)
        model = build_hf_model(cfg, seed=0)
        tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, N_TOKENS).tolist()
        path = hf_to_gguf(model, tmp_path_factory.mktemp("hf-oracle") / f"{arch}.gguf")
        _CACHE[arch] = (arch, cfg, model, tokens, path, hf_logits(model, tokens))
    return _CACHE[arch]


@pytest.fixture(scope="module", params=["qwen35moe", "qwen35"])
def oracle(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_open_model_accepts_converted_file(oracle):
    arch, cfg, _, _, path, _ = oracle
    mf = open_model(path)
    hp = mf.hparams
    assert hp.arch == arch and not hp.has_mtp
    assert mf.layer_pattern() == "RRRA"
    assert (hp.n_layer, hp.n_embd, hp.n_vocab) == (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    assert (hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.n_rot) == (4, 2, 32, 8)
    assert (hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_conv_kernel) == (2, 4, 16, 4)
    assert hp.rope_base == pytest.approx(1e7) and hp.rms_eps == pytest.approx(1e-6)
    if arch == "qwen35moe":
        assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (8, 2, 32, 32)
    else:
        assert hp.n_ff == cfg.intermediate_size


def test_llama_cpp_matches_hf(oracle):
    _, _, _, tokens, path, ref = oracle
    assert ref.shape == (N_TOKENS, 384) and np.isfinite(ref).all()
    assert ref.std() > 1.0  # non-trivial logits, not a degenerate model
    got = llama_cpp_logits(path, tokens)
    err = np.abs(got - ref)
    assert err.max() < TOL, f"max |Δlogit| {err.max():.3g} at position {np.unravel_index(err.argmax(), err.shape)[0]}"
    assert (got.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("broken", [{"reorder_v": False}, {"norm_plus_one": False}])
def test_comparison_catches_convention_errors(broken, tmp_path, tmp_path_factory):
    """Negative control: dropping one spec §2 transform must break the agreement by far."""
    _, _, model, tokens, _, ref = _build("qwen35moe", tmp_path_factory)
    path = hf_to_gguf(model, tmp_path / "broken.gguf", **broken)
    err = np.abs(llama_cpp_logits(path, tokens) - ref).max()
    assert err > 100 * TOL, f"{broken}: llama.cpp still matches HF (max |Δ| {err:.3g})"
