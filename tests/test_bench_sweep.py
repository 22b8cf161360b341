"""bench/sweep.py's pure parts: which cells a sweep plans, the summary's arithmetic, and the report's section."""
from __future__ import annotations

import pytest

from bench.report import sweep_section
from bench.sweep import AS_IS, QUANTS, QUICK, UD_Q4_K_XL, avx2_over_avx512, plan_cells, summarise_cells


def _cell(llama: float, ours: float, avx512: float, avx2: float, prefill: float = 1.0,
          rounds: tuple[float, ...] = (1.0, 1.0)) -> dict:
    """A measured cell as bench/quant_mix.run_mix returns it (ours on native-avx512vnni; `rounds`: each round's
    decode ratio), with its file facts."""
    runs = {"llama_cpp": {"backend": "llama.cpp", "decode_tok_s": llama, "prefill_tok_s": 100.0},
            "ours": {"backend": "native-avx512vnni", "decode_tok_s": ours, "prefill_tok_s": 100.0 * prefill},
            "native-avx512": {"backend": "native-avx512", "decode_tok_s": avx512, "prefill_tok_s": 90.0},
            "native-avx2": {"backend": "native-avx2", "decode_tok_s": avx2, "prefill_tok_s": 80.0}}
    ratios = {n: {"decode": r["decode_tok_s"] / llama, "prefill": r["prefill_tok_s"] / 100.0}
              for n, r in runs.items() if n != "llama_cpp"}
    per_round = [{"llama_cpp": {"decode_tok_s": 10.0}, "ours": {"decode_tok_s": 10.0 * r}} for r in rounds]
    return {"runs": runs, "ours_over_llama_cpp": ratios, "rounds": per_round, "bytes": 3 << 20,
            "types": {"expert gate/up": ["Q4_K"], "output": ["Q6_K"], "dense ffn down": ["Q6_K"]},
            "step_path": {"native-avx512vnni": "one native call (fused step)"}}


def test_the_plan_measures_the_embedded_model_as_is_and_mxfp4_on_moe_shapes_only() -> None:
    cells = plan_cells(["embedded", "mid", "qwen35-9b"], ["Q4_K_M", "MXFP4_MOE"])
    assert cells == [("embedded", AS_IS), ("mid", "Q4_K_M"), ("mid", "MXFP4_MOE"), ("qwen35-9b", "Q4_K_M")]
    quick = plan_cells(list(QUICK["shapes"]), list(QUICK["quants"]))
    assert len(quick) == 1 + 2 * len(QUICK["quants"])
    assert len(plan_cells(["qwen35-2b", "qwen36-35b"], list(QUANTS))) == (len(QUANTS) - 1) + len(QUANTS)
    with pytest.raises(ValueError, match="Q4_K_S"):
        plan_cells(["mid"], ["Q4_K_S"])
    with pytest.raises(ValueError, match="qwen99"):
        plan_cells(["qwen99"], ["Q8_0"])


def test_the_xl_mix_keeps_the_router_and_norms_out_of_its_overrides() -> None:
    import re

    for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_norm.weight", "output_norm.weight"):
        hits = [p for p in UD_Q4_K_XL if re.search(p, name)]
        assert hits in ([], [r"attn_|ssm_"]), (name, hits)  # a norm is 1-D: llama.cpp never quantizes it
    assert next(t for p, t in UD_Q4_K_XL.items() if re.search(p, "blk.3.ffn_down_exps.weight")) == "Q5_K"
    assert next(t for p, t in UD_Q4_K_XL.items() if re.search(p, "blk.3.ffn_down.weight")) == "Q6_K"
    assert next(t for p, t in UD_Q4_K_XL.items() if re.search(p, "output.weight")) == "Q8_0"


def test_the_summary_counts_the_cells_and_takes_the_median_cell() -> None:
    cells = {"a/Q8_0": _cell(100, 50, 60, 45, prefill=1.2, rounds=(0.5, 0.3, 1.1)),
             "b/Q8_0": _cell(100, 130, 120, 110, rounds=(1.3, 0.9)),
             "c/Q8_0": _cell(100, 100, 100, 90, prefill=0.5), "d/Q8_0": {"error": "llama.cpp failed"}}
    s = summarise_cells(cells)
    assert s["measured"] == 3 and s["failed"] == ["d/Q8_0"]
    assert s["cells"]["a/Q8_0"] == {"decode": 0.5, "decode_median_of_rounds": 0.5, "prefill": 1.2,
                                    "avx2_over_avx512": 45 / 60, "avxvnni_over_avx512": None}
    assert s["avxvnni_over_avx512_median"] is None  # no cell ran the AVX-VNNI form
    assert s["cells"]["b/Q8_0"]["decode_median_of_rounds"] == pytest.approx(1.1)
    assert s["decode_median_of_rounds_at_least_1"] == 2  # b (1.1) and c (1.0)
    assert s["median_cell"] == "c/Q8_0" and s["median_decode"] == 1.0 and s["worst_decode_cell"] == "a/Q8_0"
    assert s["decode_at_least_1"] == 2 and s["prefill_at_least_1"] == 2 and s["both_at_least_1"] == 1
    # b's wider form is ours (VNNI, 130)
    assert s["avx2_over_avx512_min"] == 0.75 and s["avx2_over_avx512_median"] == 110 / 130
    # an even count: the lower of the two middle cells, and the median ratio between them
    two = summarise_cells({"a": _cell(100, 80, 1, 1), "b": _cell(100, 120, 1, 1)})
    assert two["median_cell"] == "a" and two["median_decode"] == 1.0
    assert summarise_cells({"x": {"error": "boom"}}) == {"cells": {}, "measured": 0, "failed": ["x"]}


def test_avx2_over_avx512_takes_the_faster_wide_form_or_none() -> None:
    c = _cell(100, 200, 100, 150)  # the VNNI form (ours) at 200 is the faster AVX512 form
    assert avx2_over_avx512(c) == 0.75
    c["runs"]["native-avxvnni"] = {"backend": "native-avxvnni", "decode_tok_s": 180.0, "prefill_tok_s": 85.0}
    assert avx2_over_avx512(c, "native-avxvnni") == 0.9
    assert summarise_cells({"m": c})["avxvnni_over_avx512_min"] == 0.9
    del c["runs"]["native-avx2"]
    assert avx2_over_avx512(c) is None


def test_the_report_section_renders_every_cell_and_the_summary() -> None:
    cells = {"mid/Q4_K_M": _cell(20.0, 30.0, 28.0, 22.0, rounds=(1.5, 1.3)),
             "mid/Q2_K": {"error": "rc 1\nllama.cpp refused the file"}}
    d = {"command": "python bench/sweep.py --quick", "date": "2026-11-27T23:40:00+00:00",
         "git": {"commit": "0123456789abcdef", "dirty": False},
         "machine": {"cpu": "x86_64", "cpu_model": "AMD EPYC", "cores": 2, "load_avg_at_start": [1.0, 0.5, 0.25],
                     "load_avg_at_end": [2.0, 1.0, 0.5]},
         "llama_cpp": "xllamacpp 1", "our_forms": ["native-avx512vnni", "native-avx512", "native-avx2"],
         "our_forms_unavailable_on_this_cpu": [], "ud_q4_k_xl_overrides": UD_Q4_K_XL,
         "settings": {"threads": 2, "rounds": 2, "prompt": 64, "decode": 32, "decoding": "greedy, plain"},
         "shapes": {"mid": {"n_layer": 24, "layers_reduced_from": None, "n_vocab": 32768, "source": "MID"},
                    "qwen35-9b": {"n_layer": 4, "layers_reduced_from": 32, "n_vocab": 248320, "source": "9B"}},
         "cells": cells, "summary": summarise_cells(cells)}
    text = "\n".join(sweep_section(d))
    assert "| qwen35-9b | 4 of 32 | 248,320 | 9B |" in text
    assert ("| mid/Q4_K_M | 3 | exp gate/up Q4_K; ffn down Q6_K; head Q6_K | fused step | 20.0 | 30.0 "
            "(native-avx512vnni) | 1.50 | 1.40 | 1.50 | 1.40 | 1.10 | 100 | 100 | 1.00 |") in text
    assert "| × decode | × decode, median of 2 rounds | × native-avx512vnni |" in text
    assert "Cells that failed: mid/Q2_K: llama.cpp refused the file." in text
    assert "median decode ratio ×1.50 (median cell mid/Q4_K_M" in text
    assert "median 0.73, least 0.73" in text  # 22 / 30: the wider form is ours (VNNI)
