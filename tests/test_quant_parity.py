"""Every quantized type against llama.cpp, on files llama.cpp quantized itself (tests/quantized.py).

KQUANT_MOE's weights (F32) go through `llama_model_quantize` with each ftype of tests.quantized.FTYPES, which
between them hold every ggml type a Qwen3.5/3.6 GGUF is published in (K-quants, i-quants 1-4 bit, MXFP4, the
legacy 32-value types, F16, BF16), mixed per tensor as llama.cpp mixes them. IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_M,
IQ1_S and IQ1_M are refused by llama.cpp without an importance matrix: they get a flat one (see tests.quantized).

Per file, by the spec §8 rules (tests/test_parity.py's helpers): mean KL(llama.cpp ‖ ours) over a teacher-forced
sequence < 0.02, top-1 agreement ≥ 0.98 counting a position where our choice is within 0.05 σ of llama.cpp's best
(raw agreement ≥ 0.95; IQ3_S, the loosest, measured 0.984 at KL 5e-3; 0.99 is test_parity's bar for 4-bit and up).
And greedy self-consistency on the default (native) backend, on every file (MTP_CASES):
decoding with MTP (drafts accepted in windows of several lengths) gives the tokens of plain decoding, and each
of those is the argmax of the engine's own logits over the whole sequence at once. Every type runs a native product
on the default backend (engine/native: kquant.c, kquant_more.c, legacy.c, half.c, iq_grid.c), so these are the
check of those kernels against llama.cpp.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.events import EngineConfig
from engine.generate import load
from tests.fixtures import KQUANT_MOE
from tests.generation import collect
from tests.oracle_llama import llama_logits
from tests.quantized import FTYPES, UD_Q4_K_M, quantized_path, tensor_roles
from tests.test_parity import kl_ref_ours, near_tie_agreement, our_logits
from tests.test_speculative import OracleDrafter

# The routed experts' gate/up type each ftype gives on KQUANT_MOE (llama.cpp's choice): the type under test.
MAIN_TYPE = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q3_K_M": "Q3_K", "Q2_K": "Q2_K", "IQ4_XS": "IQ4_XS",
             "IQ4_NL": "IQ4_NL", "MXFP4_MOE": "MXFP4", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
             "F16": "F16", "BF16": "BF16", "IQ3_S": "IQ3_S", "IQ3_XXS": "IQ3_XXS", "IQ2_XXS": "IQ2_XXS",
             "IQ2_XS": "IQ2_XS", "IQ2_M": "IQ2_S", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M"}
CASES = [(ft, None) for ft in FTYPES] + [("Q4_K_M", "ud")]
IDS = [f"UD-{ft}" if tag else ft for ft, tag in CASES]
# Q4_1 / Q5_1 pass on the native products, which take the weights' offset term as llama.cpp does: m · s with Q8_1's
# s = fp16(d · Σq), d the unrounded amax/127. The dequant path (the torch backend) keeps Σ q · fp16(d) exactly and
# misses the bar (measured: KL 0.023 / 0.013, near-tie top-1 0.979 / 0.990); adding m · (s − Σ q·fp16(d)) per block
# there moved KL from 0.071 to 3e-4 on a file with Q4_1 dense weights.
LOGIT_CASES = [pytest.param(ft, tag, id=i) for (ft, tag), i in zip(CASES, IDS)]


def _path(ftype: str, tag: str | None):  # type: ignore[no-untyped-def]
    return quantized_path(KQUANT_MOE, ftype, overrides=UD_Q4_K_M, tag=tag) if tag else quantized_path(KQUANT_MOE, ftype)


def test_every_ftype_is_listed() -> None:
    assert set(MAIN_TYPE) == set(FTYPES)


@pytest.mark.parametrize("ftype,tag", LOGIT_CASES)
def test_llama_cpp_quantized_logits_match(ftype: str, tag: str | None) -> None:
    path = _path(ftype, tag)
    roles = tensor_roles(path)
    assert roles["expert gate/up"] == [MAIN_TYPE[ftype] if not tag else "Q4_K"], roles  # the type under test
    if tag:  # the UD-like mix: Q8_0 attention / GDN / shared expert, Q5_K routed down
        assert roles["attention"] == roles["gdn"] == ["Q8_0"] and roles["expert down"] == ["Q5_K"], roles
    toks = np.random.default_rng(7).integers(0, KQUANT_MOE.n_vocab - 3, 128).tolist()
    ref = llama_logits(path, toks)
    ours = our_logits(path, toks)
    kl, near, agree = kl_ref_ours(ref, ours), near_tie_agreement(ref, ours), float((ref.argmax(-1) == ours.argmax(-1)).mean())
    assert kl < 0.02 and near >= 0.98 and agree >= 0.95, (kl, near, agree)


# Every file: with every type on a native product a decode step of these fixtures costs milliseconds.
MTP_CASES = CASES


@pytest.mark.parametrize("ftype,tag", MTP_CASES, ids=[IDS[CASES.index(c)] for c in MTP_CASES])
def test_greedy_with_mtp_is_self_consistent(ftype: str, tag: str | None) -> None:
    eng = load(_path(ftype, tag), EngineConfig(n_ctx=256))
    eng.tokenizer.eog_ids = frozenset()  # random fixtures emit end ids by chance
    prompt = np.random.default_rng(3).integers(0, KQUANT_MOE.n_vocab - 3, 6).tolist()
    plain, _, _, _ = collect(eng, prompt, max_tokens=8, mtp=False)
    eng.reset()
    eng.drafter = OracleDrafter(eng.drafter, plain, len(prompt), wrong_every=4)
    with_mtp, _, final, _ = collect(eng, prompt, max_tokens=8, mtp=True, draft=3)
    assert with_mtp == plain and final.speculative.accepted >= 3  # verify windows of several tokens were kept
    m = eng.runner
    seq = prompt + plain
    logits = m.forward(seq, m.new_cache(256), logit_rows="all").logits
    assert torch.argmax(logits[len(prompt) - 1:-1], -1).tolist() == plain
